//! Constrained tool calls under random schemas, on the real vocabularies.
//!
//! Each case draws tools with random `parameters` schemas (nested objects
//! to depth 3, arrays with item bounds, enums, integer and number ranges,
//! strings with `maxLength` and `pattern`, required and optional keys,
//! `anyOf`), then produces one assistant output by sampling uniformly
//! (seeded) from the constraint's mask — a stand-in for the model's choice
//! that exercises every path the grammar allows. The output is decoded,
//! parsed with the format's own parser, and every call is checked against
//! its tool's schema with an independent validator (`jsonschema`). The same
//! number of tokens sampled without the mask is parsed as a baseline.
//!
//! Vocabularies: Kimi tiktoken (the synthesized default model's tokenizer;
//! the K2 run registers K2's specials over the same ranks), the tiny-llama
//! fixture's `tokenizer.json`, and SmolLM2's when its GGUF is cached.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::{json, Map, Value};

use common::schemas::{check_calls, draw_spec, Draw, Rng};

use caracal::chat::toolcall::{
    HermesStreamParser, K2StreamParser, K3StreamParser, ParseEvent, StreamParser,
};
use caracal::constrain::{
    Constraint, ConstraintFactory, ConstraintSpec, TokenEnv, ToolChoice, ToolFormat, ToolsSpec,
};
use caracal::convert::synth::{
    synthesize, truncated_o200k_rank_file, SynthOptions, DEFAULT_SEED, KIMI_NUM_RANKS,
};
use caracal::text::tokenizer::TextTokenizer;

/// Tool calls each vocabulary's run must produce.
const CALLS_PER_RUN: usize = 350;
/// Tokens one output may take before the case counts as not terminating.
const MAX_TOKENS: usize = 6_000;
/// Past this many tokens an output draws from the allowed closers (special
/// tokens and tokens without letters or digits) when there are any, so that
/// values uniform sampling would make very long (a number's digits before
/// K3's `<|close|>`, one closer among a thousand digit tokens) end.
const SOFT_BUDGET: usize = 300;

/// A vocabulary and how its format's output is read back.
struct Run {
    name: &'static str,
    tok: Arc<TextTokenizer>,
    factory: ConstraintFactory,
    format: ToolFormat,
    /// Text that makes an `auto` case open its calls (the model's choice to call).
    trigger: String,
}

impl Run {
    fn new(name: &'static str, dir: &Path, format: ToolFormat, trigger: &str) -> Run {
        let tok = Arc::new(TextTokenizer::from_dir(dir).expect("tokenizer loads"));
        let env = TokenEnv::load(dir, tok.clone(), None).expect("token env");
        Run {
            name,
            tok,
            factory: ConstraintFactory::new(env).expect("factory"),
            format,
            trigger: trigger.to_string(),
        }
    }

    /// Parses an output; the calls as (name, arguments), or what was malformed.
    fn parse(&self, text: &str) -> Result<Vec<(String, Value)>, String> {
        // The parsers the gateway runs on model output, so a call that
        // passes here is a call a client receives.
        let mut parser: Box<dyn StreamParser> = match self.format {
            ToolFormat::KimiK2 { .. } => Box::new(K2StreamParser::new()),
            ToolFormat::KimiK3 { thinking } => Box::new(K3StreamParser::new(thinking)),
            ToolFormat::Hermes => Box::new(HermesStreamParser::new()),
        };
        let mut events = parser.push(text);
        events.extend(parser.finish());
        let mut calls: Vec<(String, String)> = Vec::new();
        for e in events {
            match e {
                ParseEvent::Malformed { message, .. } => return Err(message),
                ParseEvent::ToolCallStart { name, .. } => calls.push((name, String::new())),
                ParseEvent::ToolCallArgs { delta, .. } => match calls.last_mut() {
                    Some(c) => c.1.push_str(&delta),
                    None => return Err("arguments outside a call".into()),
                },
                _ => {}
            }
        }
        calls
            .into_iter()
            .map(|(n, a)| match serde_json::from_str(&a) {
                Ok(v) => Ok((n, v)),
                Err(e) => Err(format!("arguments {a:?}: {e}")),
            })
            .collect()
    }
}

/// Samples one output under the constraint; returns its tokens.
fn sample(run: &Run, spec: &ToolsSpec, rng: &mut Rng) -> Result<Vec<u32>, String> {
    let mut c = run
        .factory
        .compile(&ConstraintSpec::Tools(spec.clone()))
        .map_err(|e| format!("compile: {e}"))?;
    let eos = run.factory.env().eos().to_vec();
    let jump_forward = rng.chance(0.5);
    // An auto case writes some free text, then opens its calls: the
    // trigger's text is steered token by token.
    let mut steer: Vec<u8> = if spec.choice == ToolChoice::Auto {
        run.trigger.as_bytes().to_vec()
    } else {
        Vec::new()
    };
    let env = run.factory.env();
    let free_tokens = rng.below(6);
    let mut out = Vec::new();
    let trigger = steer.clone();
    // A token that does not continue the trigger restarts it.
    let push = |t: u32, steer: &mut Vec<u8>, out: &mut Vec<u32>| {
        let bytes = env.decode(&[t]);
        if !steer.is_empty() {
            if steer.starts_with(&bytes) {
                steer.drain(..bytes.len());
            } else {
                *steer = trigger.clone();
            }
        }
        out.push(t);
    };
    while !c.is_done() {
        if out.len() > MAX_TOKENS {
            let text = String::from_utf8_lossy(&env.decode(&out[out.len() - 300..])).into_owned();
            return Err(format!(
                "no end after {MAX_TOKENS} tokens; last ones: {text}"
            ));
        }
        if jump_forward {
            for t in c.forced_tokens().map_err(|e| e.to_string())? {
                c.consume(t).map_err(|e| e.to_string())?;
                push(t, &mut steer, &mut out);
            }
            if c.is_done() {
                break;
            }
        }
        let mask = c.compute_mask().map_err(|e| e.to_string())?;
        let steering = !steer.is_empty() && out.len() >= free_tokens;
        let toward: Vec<u32> = if steering {
            mask.allowed()
                .filter(|&t| {
                    let b = env.decode(&[t]);
                    !b.is_empty() && steer.starts_with(&b)
                })
                .collect()
        } else {
            Vec::new()
        };
        let t = if let Some(&t) = toward.iter().max_by_key(|&&t| env.decode(&[t]).len()) {
            t
        } else {
            let allowed: Vec<u32> = mask
                .allowed()
                .filter(|t| steer.is_empty() || !eos.contains(t))
                .collect();
            if allowed.is_empty() {
                return Err("empty mask".into());
            }
            let closers: Vec<u32> = if out.len() > SOFT_BUDGET {
                allowed
                    .iter()
                    .copied()
                    .filter(|&t| {
                        env.trie().is_special_token(t)
                            || env.decode(&[t]).iter().all(|b| !b.is_ascii_alphanumeric())
                    })
                    .collect()
            } else {
                Vec::new()
            };
            let pool = if closers.is_empty() {
                &allowed
            } else {
                &closers
            };
            pool[rng.below(pool.len())]
        };
        c.consume(t).map_err(|e| e.to_string())?;
        if eos.contains(&t) {
            break;
        }
        push(t, &mut steer, &mut out);
    }
    Ok(out)
}

/// Counts of one run.
#[derive(Debug, Default)]
struct Tally {
    cases: usize,
    calls: usize,
    tokens: usize,
    unconstrained_parsed: usize,
    /// Outputs with K3 `argument` elements (not the `json` fallback).
    argument_elements: usize,
}

fn stress(run: &Run, seed: u64) -> Tally {
    let mut rng = Rng(seed);
    let mut tally = Tally::default();
    let vocab = run.factory.env().vocab_size();
    while tally.calls < CALLS_PER_RUN {
        let spec = draw_spec(
            &mut rng,
            run.format,
            Draw {
                auto: true,
                finite_numbers: false,
            },
        );
        let tokens = sample(run, &spec, &mut rng)
            .unwrap_or_else(|e| panic!("{} case {}: {e}\n{spec:#?}", run.name, tally.cases));
        let text = run.tok.decode(&tokens, false).expect("decodes");
        let calls = run
            .parse(&text)
            .and_then(|c| check_calls(&spec, &c).map(|_| c))
            .unwrap_or_else(|e| {
                panic!(
                    "{} case {}: {e}\noutput: {text}\n{spec:#?}",
                    run.name, tally.cases
                )
            });
        if tally.cases < 2 {
            println!("{} sample output: {text}", run.name);
        }
        tally.argument_elements += usize::from(text.contains("<|open|>argument"));
        tally.cases += 1;
        tally.calls += calls.len();
        tally.tokens += tokens.len();
        // The same length without the mask.
        let free: Vec<u32> = (0..tokens.len()).map(|_| rng.below(vocab) as u32).collect();
        let free_text = run.tok.decode(&free, false).unwrap_or_default();
        let parsed = run.parse(&free_text).and_then(|c| check_calls(&spec, &c));
        tally.unconstrained_parsed += usize::from(parsed.is_ok());
    }
    println!(
        "{}: {} tool calls in {} outputs ({} tokens) parsed and matched their schemas; \
         unconstrained outputs of the same lengths that parsed to valid calls: {} of {}",
        run.name, tally.calls, tally.cases, tally.tokens, tally.unconstrained_parsed, tally.cases
    );
    assert!(tally.calls >= CALLS_PER_RUN);
    tally
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("constrain-{tag}"));
    if dir.exists() {
        std::fs::remove_dir_all(&dir).expect("stale temp dir is removable");
    }
    dir
}

#[test]
fn k3_calls_on_the_synthesized_kimi_tokenizer_always_parse_and_validate() {
    let dir = temp_dir("synth");
    synthesize(
        &dir,
        &SynthOptions {
            seed: DEFAULT_SEED,
            progress: false,
            ..SynthOptions::default()
        },
    )
    .expect("synth succeeds");
    let run = Run::new(
        "Kimi K3 XTML (synth tiktoken, 163,842 ids)",
        &dir,
        ToolFormat::KimiK3 { thinking: false },
        "<|close|>response<|sep|><|open|>tools<|sep|>",
    );
    let t = stress(&run, 3);
    assert_eq!(t.unconstrained_parsed, 0);
    assert!(
        t.argument_elements * 2 > t.cases,
        "most calls use argument elements: {t:?}"
    );
}

#[test]
fn k2_calls_on_kimi_ranks_always_parse_and_validate() {
    let dir = temp_dir("k2");
    std::fs::create_dir_all(&dir).expect("temp dir");
    std::fs::write(
        dir.join("tiktoken.model"),
        truncated_o200k_rank_file(KIMI_NUM_RANKS).expect("ranks"),
    )
    .expect("write ranks");
    let names = [
        (163_584, "[BOS]"),
        (163_585, "[EOS]"),
        (163_586, "<|im_end|>"),
        (163_595, "<|tool_calls_section_begin|>"),
        (163_596, "<|tool_calls_section_end|>"),
        (163_597, "<|tool_call_begin|>"),
        (163_598, "<|tool_call_argument_begin|>"),
        (163_599, "<|tool_call_end|>"),
    ];
    let added: Map<String, Value> = names
        .iter()
        .map(|(id, n)| (id.to_string(), json!({"content": n, "special": true})))
        .collect();
    let config = json!({"added_tokens_decoder": added, "eos_token": "<|im_end|>"});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).expect("write config");
    let run = Run::new(
        "Kimi K2 (Kimi tiktoken ranks)",
        &dir,
        ToolFormat::KimiK2 {
            first_call_index: 0,
            thinking: false,
        },
        "<|tool_calls_section_begin|>",
    );
    let t = stress(&run, 2);
    assert_eq!(t.unconstrained_parsed, 0);
}

#[test]
fn hermes_calls_on_tokenizer_json_vocabularies_always_parse_and_validate() {
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-llama");
    let run = Run::new(
        "Hermes (tiny-llama tokenizer.json, 512 ids)",
        &tiny,
        ToolFormat::Hermes,
        "<tool_call>",
    );
    let t = stress(&run, 1);
    assert_eq!(t.unconstrained_parsed, 0);
    let gguf =
        Path::new(env!("CARGO_MANIFEST_DIR")).join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !gguf.exists() {
        eprintln!(
            "SKIPPED SmolLM2: needs {} (run tools/fetch-models.sh)",
            gguf.display()
        );
        return;
    }
    let dir = temp_dir("smollm2");
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = caracal::checkpoint::gguf::GgufFile::open(&gguf).expect("gguf opens");
    let files = caracal::checkpoint::gguf::tokenizer::build_hf_tokenizer(&file, None)
        .expect("tokenizer imports");
    std::fs::write(dir.join("tokenizer.json"), files.tokenizer_json).expect("write");
    std::fs::write(dir.join("tokenizer_config.json"), files.tokenizer_config).expect("write");
    let run = Run::new(
        "Hermes (SmolLM2 tokenizer.json, 49,152 ids)",
        &dir,
        ToolFormat::Hermes,
        "<tool_call>",
    );
    let t = stress(&run, 4);
    assert_eq!(t.unconstrained_parsed, 0);
}
