//! Mask time per decode step of constrained tool calls.
//!
//! Each sample compiles a fresh constraint (untimed), then replays a fixed
//! reference call through it — `compute_mask` and `consume` per token —
//! so the reported time per element is the per-step cost. Vocabularies:
//! SmolLM2's `tokenizer.json` (49,152 ids, Hermes format; imported from the
//! cached GGUF, skipped when absent) and the Kimi tiktoken vocabulary of the
//! synthesized default model (163,842 ids, K3 XTML and K2 formats).
//!
//! `cargo bench -p caracal --bench constrain` (or `--profile dev` for a
//! quick run: llguidance is a dependency, built at -O3 either way).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use serde_json::json;

use caracal::constrain::{
    Constraint, ConstraintFactory, ConstraintSpec, TokenEnv, ToolChoice, ToolDecl, ToolFormat,
    ToolsSpec,
};
use caracal::convert::synth::{k3_tokenizer_config, truncated_o200k_rank_file, KIMI_NUM_RANKS};
use caracal::text::tokenizer::TextTokenizer;

fn weather() -> ToolDecl {
    ToolDecl {
        name: "get_weather".into(),
        parameters: json!({"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 40},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "units": {"enum": ["celsius", "fahrenheit"]},
            "include_hourly_forecast_details": {"type": "boolean"}
        }, "required": ["city", "days"], "additionalProperties": false}),
    }
}

fn spec(format: ToolFormat) -> ConstraintSpec {
    ConstraintSpec::Tools(ToolsSpec {
        tools: vec![weather()],
        choice: ToolChoice::Required,
        parallel: false,
        format,
    })
}

fn temp(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("caracal-bench-constrain-{tag}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn load(dir: &Path) -> (Arc<TextTokenizer>, ConstraintFactory) {
    let tok = Arc::new(TextTokenizer::from_dir(dir).expect("tokenizer"));
    let env = TokenEnv::load(dir, tok.clone(), None).expect("token env");
    (tok, ConstraintFactory::new(env).expect("factory"))
}

fn bench_one(
    c: &mut Criterion,
    name: &str,
    tok: &TextTokenizer,
    f: &ConstraintFactory,
    s: &ConstraintSpec,
    text: &str,
) {
    let ids = tok.encode_chat(text).expect("encodes");
    let mut g = c.benchmark_group("constrain_step");
    g.throughput(Throughput::Elements(ids.len() as u64));
    g.bench_function(name, |b| {
        b.iter_batched(
            || f.compile(s).expect("compiles"),
            |mut con| {
                for &t in &ids {
                    let m = con.compute_mask().expect("mask");
                    assert!(m.is_allowed(t));
                    con.consume(t).expect("consume");
                }
                con
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

fn benches(c: &mut Criterion) {
    let gguf =
        Path::new(env!("CARGO_MANIFEST_DIR")).join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if gguf.exists() {
        let dir = temp("smollm2");
        let file = caracal::checkpoint::gguf::GgufFile::open(&gguf).expect("gguf");
        let files = caracal::checkpoint::gguf::tokenizer::build_hf_tokenizer(&file, None)
            .expect("tokenizer");
        std::fs::write(dir.join("tokenizer.json"), files.tokenizer_json).expect("write");
        std::fs::write(dir.join("tokenizer_config.json"), files.tokenizer_config).expect("write");
        let (tok, f) = load(&dir);
        let text = "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"San Francisco\",\"days\":3,\"units\":\"celsius\",\"include_hourly_forecast_details\":true}}\n</tool_call>";
        bench_one(
            c,
            "hermes_smollm2_49k",
            &tok,
            &f,
            &spec(ToolFormat::Hermes),
            text,
        );
    } else {
        eprintln!(
            "SKIPPED SmolLM2: {} is absent (run tools/fetch-models.sh)",
            gguf.display()
        );
    }
    let dir = temp("kimi");
    std::fs::write(
        dir.join("tiktoken.model"),
        truncated_o200k_rank_file(KIMI_NUM_RANKS).expect("ranks"),
    )
    .expect("write");
    std::fs::write(
        dir.join("tokenizer_config.json"),
        k3_tokenizer_config().to_string(),
    )
    .expect("write");
    let (tok, f) = load(&dir);
    let text = "<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|><|open|>argument key=\"city\" type=\"string\"<|sep|>San Francisco<|close|>argument<|sep|><|open|>argument key=\"days\" type=\"number\"<|sep|>3<|close|>argument<|sep|><|open|>argument key=\"units\" type=\"string\"<|sep|>celsius<|close|>argument<|sep|><|open|>argument key=\"include_hourly_forecast_details\" type=\"boolean\"<|sep|>true<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>";
    bench_one(
        c,
        "k3_xtml_kimi_163k",
        &tok,
        &f,
        &spec(ToolFormat::KimiK3 { thinking: false }),
        text,
    );
}

criterion_group!(constrain, benches);
criterion_main!(constrain);
