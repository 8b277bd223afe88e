//! `caracal::eval::perplexity` against a direct computation, and on the real
//! SmolLM2-135M-Instruct (imported from the cached GGUF at test time).

use std::path::Path;

mod common;

use caracal::checkpoint::gguf::{import_gguf, ImportOptions, OutDtype};
use caracal::eval::{perplexity, tokenize_like_llama_cpp, PplOptions};
use caracal::generate::{prompt_logits, LoadedModel};
use common::{fixture, smollm2_gguf, TempDir};

const GPL3: &str = "/usr/share/common-licenses/GPL-3";

fn gpl3_or_builtin() -> String {
    std::fs::read_to_string(GPL3).unwrap_or_else(|_| {
        // Some systems lack the Debian licence files; any English prose works here.
        "The licenses for most software and other practical works are designed to take away your freedom \
         to share and change the works. By contrast, the GNU General Public License is intended to guarantee \
         your freedom to share and change all versions of a program. "
            .repeat(40)
    })
}

/// The llama-perplexity procedure written out plainly: per window, the full
/// forward's logits from `prompt_logits`, an f64 log-softmax, and the mean.
fn direct_ppl(m: &LoadedModel, tokens: &[u32], ctx: usize, bos: Option<u32>) -> f64 {
    let v = m.model.info().vocab_size;
    let first = ctx / 2;
    let (mut nll, mut count) = (0.0f64, 0usize);
    for w in 0..tokens.len() / ctx {
        let mut window = tokens[w * ctx..(w + 1) * ctx].to_vec();
        if let Some(b) = bos {
            window[0] = b;
        }
        let logits = prompt_logits(m.model.as_ref(), &window).unwrap();
        for pos in first..ctx - 1 {
            let row = &logits[pos * v..(pos + 1) * v];
            let max = row.iter().map(|&x| x as f64).fold(f64::MIN, f64::max);
            let lse = max
                + row
                    .iter()
                    .map(|&x| (x as f64 - max).exp())
                    .sum::<f64>()
                    .ln();
            nll += lse - row[window[pos + 1] as usize] as f64;
            count += 1;
        }
    }
    (nll / count as f64).exp()
}

/// The two paths differ in how the window is split into forwards (one
/// forward vs two at `ctx/2`) and in f32-vs-f64 exponentials; both move the
/// perplexity by far less than 1e-4 relative.
const PPL_REL_TOL: f64 = 1e-4;

#[test]
fn perplexity_equals_a_direct_computation_from_prompt_logits() {
    let m = LoadedModel::load(&fixture("tiny-llama")).unwrap();
    let tok = m.tokenizer.as_ref().unwrap();
    let text: String = gpl3_or_builtin().chars().take(3000).collect();
    let (tokens, bos) = tokenize_like_llama_cpp(tok, &text).unwrap();
    assert_eq!(bos, None, "the fixture tokenizer does not add BOS");
    let ctx = 64;
    assert!(tokens.len() >= 3 * ctx, "{} tokens", tokens.len());
    for bos in [None, Some(1u32)] {
        let r = perplexity(
            m.model.as_ref(),
            &tokens,
            &PplOptions {
                ctx,
                bos,
                ..Default::default()
            },
        )
        .unwrap();
        let want = direct_ppl(&m, &tokens, ctx, bos);
        eprintln!(
            "tiny-llama ctx {ctx} bos {bos:?}: ppl {} (direct {want}), {} windows",
            r.ppl, r.chunks
        );
        assert_eq!(r.chunks, tokens.len() / ctx);
        assert_eq!(r.scored, r.chunks * (ctx - 1 - ctx / 2));
        assert_eq!(r.running.len(), r.chunks);
        assert!(
            (r.ppl - want).abs() <= PPL_REL_TOL * want,
            "{} vs {want}",
            r.ppl
        );
        assert!((r.running.last().unwrap() - r.ppl).abs() < 1e-12);
        assert!(r.ppl_stderr > 0.0 && r.ppl_stderr < r.ppl);
    }
}

#[test]
fn perplexity_honours_max_chunks_and_rejects_short_texts() {
    let m = LoadedModel::load(&fixture("tiny-llama")).unwrap();
    let tokens: Vec<u32> = (0..200u32).map(|i| (i * 37 + 11) % 512).collect();
    let r = perplexity(
        m.model.as_ref(),
        &tokens,
        &PplOptions {
            ctx: 32,
            max_chunks: Some(2),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(r.chunks, 2);
    assert!((r.ppl - direct_ppl(&m, &tokens[..64], 32, None)).abs() <= PPL_REL_TOL * r.ppl);
    let err = perplexity(
        m.model.as_ref(),
        &tokens[..63],
        &PplOptions {
            ctx: 32,
            ..Default::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("at least 64 tokens"), "{err}");
    let err = perplexity(
        m.model.as_ref(),
        &tokens,
        &PplOptions {
            ctx: 1024,
            ..Default::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("context length"), "{err}");
}

/// SmolLM2-135M-Instruct (Q4_1 weights) on the first 2,048 tokens of GPL-3 at
/// ctx 512 (4 windows, 1,020 scored tokens). llama.cpp gives 18.39 on the
/// whole file; the first part of the licence is its preamble, so the
/// partial figure differs, but a working model must land in single or low
/// double digits while a broken one (wrong RoPE layout, untied head, …)
/// goes to hundreds or thousands.
#[test]
fn smollm2_perplexity_on_gpl3_is_in_a_sane_range() {
    let Some(gguf) = smollm2_gguf("the SmolLM2 perplexity test") else {
        return;
    };
    if !Path::new(GPL3).exists() {
        eprintln!("SKIPPED: needs {GPL3}");
        return;
    }
    let dir = TempDir::new("smollm2");
    import_gguf(
        &gguf,
        &dir.0,
        &ImportOptions {
            dtype: OutDtype::Bf16,
            progress: false,
        },
    )
    .unwrap();
    let m = LoadedModel::load(&dir.0).unwrap();
    let (tokens, bos) = tokenize_like_llama_cpp(
        m.tokenizer.as_ref().unwrap(),
        &std::fs::read_to_string(GPL3).unwrap(),
    )
    .unwrap();
    assert_eq!(bos, None, "SmolLM2's GGUF says add_bos_token = false");
    let r = perplexity(
        m.model.as_ref(),
        &tokens[..2048],
        &PplOptions {
            ctx: 512,
            ..Default::default()
        },
    )
    .unwrap();
    eprintln!(
        "SmolLM2-135M-Instruct bf16, GPL-3 first 2048 of {} tokens, ctx 512: PPL {:.4} +/- {:.4} ({:.1} tokens/s)",
        tokens.len(),
        r.ppl,
        r.ppl_stderr,
        r.tokens_per_s
    );
    assert_eq!(r.chunks, 4);
    assert!(r.ppl > 3.0 && r.ppl < 60.0, "PPL {}", r.ppl);
}
