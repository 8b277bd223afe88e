//! The actor runtime on real tiny checkpoints: continuous batching gives
//! the tokens of sequential runs, expert parallelism does not change
//! results, cached continuations equal cold runs (including KDA snapshot
//! restores), cancellation frees everything, and no page or lock leaks
//! under thousands of random requests with random cancellations.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use caracal::generate::{generate, GenerateRequest, LoadedModel};
use caracal::models::CausalLm;
use caracal_actors::messages::{StopConditions, SubmitError, TokenEvent, ValidRequest};
use caracal_actors::runtime::{Engine, EngineConfig};
use caracal_actors::scheduler::{SchedulerConfig, SchedulerState, StepOutcome};
use caracal_actors::session_memory::{MemoryConfig, SessionMemory};
use caracal_kernels::sampling::SamplingParams;
use proptest::prelude::*;
use tokio::sync::mpsc;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn model(name: &str) -> Arc<dyn CausalLm> {
    Arc::from(LoadedModel::load(&fixture(name)).unwrap().model)
}

fn greedy(prompt: Vec<u32>, max_tokens: usize, session: Option<&str>) -> ValidRequest {
    ValidRequest {
        session: session.map(String::from),
        prompt,
        cache_key: None,
        max_tokens,
        sampling: SamplingParams::greedy(),
        stop: StopConditions::default(),
        ..Default::default()
    }
}

/// Collected output of one request.
#[derive(Debug, Clone, PartialEq)]
struct Done {
    ids: Vec<u32>,
    cached: usize,
    miss: String,
}

async fn collect(mut rx: mpsc::Receiver<TokenEvent>) -> Done {
    let mut ids = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            TokenEvent::Token { id, .. } => ids.push(id),
            TokenEvent::Finished { cache, .. } => {
                return Done {
                    ids,
                    cached: cache.cached_tokens,
                    miss: cache.miss_reason.map(|r| r.to_string()).unwrap_or_default(),
                }
            }
            TokenEvent::Error { kind, message } => panic!("{kind}: {message}"),
        }
    }
    panic!("stream closed without Finished")
}

fn small_pages() -> EngineConfig {
    EngineConfig {
        scheduler: SchedulerConfig {
            page_size: 4,
            state_checkpoint_interval: 8,
            chunked_prefill_size: 7,
            ..Default::default()
        },
        kv_cache_memory: 8 << 20,
        ..Default::default()
    }
}

fn prompts() -> Vec<Vec<u32>> {
    (0..8u32)
        .map(|i| {
            (0..(5 + 3 * i))
                .map(|j| 20 + (i * 31 + j * 7) % 400)
                .collect()
        })
        .collect()
}

/// Single-sequence reference output (no runtime involved).
fn reference(m: &dyn CausalLm, prompt: &[u32], n: usize) -> Vec<u32> {
    let req = GenerateRequest {
        prompt_ids: prompt.to_vec(),
        max_tokens: n,
        sampling: SamplingParams::greedy(),
        stop_ids: vec![],
    };
    generate(m, &req, |_| {}).unwrap().token_ids
}

#[test]
fn concurrent_requests_get_the_tokens_of_sequential_runs() {
    for name in ["tiny-llama", "tiny-deepseek-v3", "tiny-kimi-linear"] {
        let m = model(name);
        let want: Vec<Vec<u32>> = prompts()
            .iter()
            .map(|p| reference(m.as_ref(), p, 10))
            .collect();
        let got = actix::System::new().block_on(async {
            let engine = Engine::start(m.clone(), small_pages(), None);
            let mut rxs = Vec::new();
            for p in prompts() {
                rxs.push(engine.submit(greedy(p, 10, None)).await.unwrap());
            }
            futures::future::join_all(rxs.into_iter().map(collect)).await
        });
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(&g.ids, w, "{name}");
        }
    }
}

#[test]
fn expert_parallel_1_2_4_give_identical_tokens() {
    for name in ["tiny-deepseek-v3", "tiny-kimi-linear"] {
        let mut outs = Vec::new();
        for ep in [1, 2, 4] {
            let m = model(name);
            outs.push(actix::System::new().block_on(async {
                let engine = Engine::start(
                    m,
                    EngineConfig {
                        ep,
                        ..small_pages()
                    },
                    None,
                );
                if ep > 1 {
                    assert_eq!(engine.shards.as_ref().unwrap().num_shards(), ep);
                }
                let mut rxs = Vec::new();
                for p in prompts() {
                    rxs.push(engine.submit(greedy(p, 12, None)).await.unwrap());
                }
                let done = futures::future::join_all(rxs.into_iter().map(collect)).await;
                if let Some(s) = &engine.shards {
                    let counts = s.counts().await;
                    let total: u64 = counts.iter().flatten().sum();
                    assert!(total > 0, "shards counted no expert selections");
                    let place = s.rebalance().await;
                    assert!(place.iter().flatten().all(|&x| x < ep));
                }
                done.into_iter().map(|d| d.ids).collect::<Vec<_>>()
            }));
        }
        assert_eq!(outs[0], outs[1], "{name}: ep 2 differs from ep 1");
        assert_eq!(outs[0], outs[2], "{name}: ep 4 differs from ep 1");
    }
}

/// Turn 2 reuses turn 1's cache and still produces the tokens of a cold run.
#[test]
fn cached_continuation_equals_cold_run() {
    for name in ["tiny-llama", "tiny-deepseek-v3", "tiny-kimi-linear"] {
        let m = model(name);
        let turn1: Vec<u32> = (0..23).map(|j| 30 + (j * 13) % 300).collect();
        let (warm, cold_engine_out) = actix::System::new().block_on(async {
            let engine = Engine::start(m.clone(), small_pages(), None);
            let first = collect(
                engine
                    .submit(greedy(turn1.clone(), 9, Some("agent")))
                    .await
                    .unwrap(),
            )
            .await;
            let mut turn2 = turn1.clone();
            turn2.extend(&first.ids);
            turn2.extend([41, 42, 43, 44, 45]);
            let second = collect(
                engine
                    .submit(greedy(turn2.clone(), 12, Some("agent")))
                    .await
                    .unwrap(),
            )
            .await;
            let fresh = Engine::start(m.clone(), small_pages(), None);
            let cold = collect(fresh.submit(greedy(turn2.clone(), 12, None)).await.unwrap()).await;
            (second, (cold, turn2))
        });
        let (cold, turn2) = cold_engine_out;
        assert!(
            warm.cached > 0,
            "{name}: the follow-up turn hit nothing ({})",
            warm.miss
        );
        assert_eq!(cold.cached, 0);
        assert_eq!(
            warm.ids, cold.ids,
            "{name}: cached continuation differs from a cold run"
        );
        assert_eq!(
            warm.ids,
            reference(m.as_ref(), &turn2, 12),
            "{name}: runtime differs from single-sequence generation"
        );
        if name == "tiny-kimi-linear" {
            // Hybrid: hits only at page-aligned snapshot boundaries.
            assert_eq!(warm.cached % 4, 0);
        }
    }
}

/// A KDA state restored at the wrong boundary must change the output: the
/// equality above would catch a wrong snapshot.
#[test]
fn wrong_kda_snapshot_changes_the_output() {
    let m = model("tiny-kimi-linear");
    let seq: Vec<u32> = (0..24).map(|j| 30 + (j * 13) % 300).collect();
    let mut cache =
        caracal_kernels::paged::KvPool::new(m.info().kv_layers, 16, 4, m.info().kv_width);
    let mut right = m.new_state();
    let run = |cache: &mut caracal_kernels::paged::KvPool,
               st: &mut caracal::models::SeqState,
               t: &[u32],
               mode| {
        m.forward(
            cache,
            &mut [caracal::models::SeqBatch {
                tokens: t,
                state: st,
                logits: mode,
                embeds: &[],
            }],
        )
        .unwrap()
    };
    run(
        &mut cache,
        &mut right,
        &seq[..8],
        caracal::models::LogitsMode::None,
    );
    let snap_at_8 = right.linear.clone();
    run(
        &mut cache,
        &mut right,
        &seq[8..12],
        caracal::models::LogitsMode::None,
    );
    let good = run(
        &mut cache,
        &mut right.clone(),
        &seq[12..],
        caracal::models::LogitsMode::Last,
    );
    let mut wrong = right.clone();
    wrong.linear = snap_at_8; // KV says 12 tokens, KDA state says 8
    let bad = run(
        &mut cache,
        &mut wrong,
        &seq[12..],
        caracal::models::LogitsMode::Last,
    );
    let diff = good
        .iter()
        .zip(&bad)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(
        diff > 1e-2,
        "a stale KDA state went unnoticed (max logit change {diff})"
    );
}

#[test]
fn dropping_the_receiver_cancels_and_frees_pages() {
    let m = model("tiny-llama");
    actix::System::new().block_on(async {
        let engine = Engine::start(m, small_pages(), None);
        let mut rx = engine
            .submit(greedy(vec![5, 6, 7, 8, 9], 200, None))
            .await
            .unwrap();
        assert!(matches!(rx.recv().await, Some(TokenEvent::Token { .. })));
        drop(rx);
        // Another request goes through afterwards; the cancelled one is gone.
        let other = collect(
            engine
                .submit(greedy(vec![11, 12, 13], 3, None))
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(other.ids.len(), 3);
        let stats = engine.scheduler_stats().await.unwrap();
        assert_eq!(stats.running, 0);
        assert_eq!(stats.cancelled, 1);
        let mem = engine.memory_stats().await.unwrap();
        assert_eq!(
            mem.free_pages + mem.cached_pages,
            mem.total_pages,
            "{mem:?}"
        );
        assert!(
            mem.cached_pages <= 1,
            "the cancelled sequence cached its output: {mem:?}"
        );
    });
}

#[test]
fn full_waiting_queue_answers_overloaded() {
    let m = model("tiny-llama");
    let cfg = SchedulerConfig {
        max_waiting_requests: 2,
        ..Default::default()
    };
    let mut s = SchedulerState::new(m, 64, cfg, None);
    let (tx, _rx) = mpsc::channel(8);
    s.enqueue(greedy(vec![1, 2], 2, None), tx.clone()).unwrap();
    s.enqueue(greedy(vec![1, 2], 2, None), tx.clone()).unwrap();
    let err = s.enqueue(greedy(vec![1, 2], 2, None), tx).unwrap_err();
    assert!(
        matches!(
            err,
            SubmitError::Overloaded {
                waiting: 2,
                limit: 2
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("overloaded"));
}

#[test]
fn prompt_past_the_context_is_refused() {
    let m = model("tiny-llama");
    let ctx = m.info().max_position;
    let mut s = SchedulerState::new(m, 64, SchedulerConfig::default(), None);
    let (tx, _rx) = mpsc::channel(8);
    let err = s.enqueue(greedy(vec![3; ctx], 2, None), tx).unwrap_err();
    assert!(err.to_string().contains("context length"), "{err}");
}

#[test]
fn client_that_stops_reading_is_paused_not_buffered() {
    let m = model("tiny-llama");
    let cfg = SchedulerConfig {
        page_size: 4,
        ..Default::default()
    };
    let mem = SessionMemory::new(MemoryConfig {
        num_pages: 128,
        page_size: 4,
        session_ttl: std::time::Duration::from_secs(60),
    });
    let mut s = SchedulerState::with_memory(m, mem, cfg.clone(), None);
    let (tx, mut rx) = mpsc::channel(3);
    s.enqueue(greedy(vec![5, 6, 7], 50, None), tx).unwrap();
    let mut ran = 0;
    while s.step() == StepOutcome::Ran {
        ran += 1;
        assert!(ran < 20, "kept decoding for a client that does not read");
    }
    assert_eq!(s.step(), StepOutcome::Paused);
    let mut got = 0;
    while rx.try_recv().is_ok() {
        got += 1;
    }
    assert_eq!(got, 3, "exactly the credit was produced");
    assert_eq!(s.step(), StepOutcome::Ran, "reading resumes decoding");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Thousands of random requests (shared prefixes, random lengths) with
    /// random cancellations: afterwards no page is leaked and no lock held.
    #[test]
    fn random_requests_and_cancellations_leak_nothing(
        seed in any::<u64>(),
        hybrid in any::<bool>(),
        pages in 24usize..96,
    ) {
        let m = model(if hybrid { "tiny-kimi-linear" } else { "tiny-llama" });
        let cfg = SchedulerConfig {
            page_size: 4, max_running_requests: 6, max_batch_tokens: 48, chunked_prefill_size: 9,
            state_checkpoint_interval: 8, max_waiting_requests: 1000, ..Default::default()
        };
        let mem = SessionMemory::new(MemoryConfig { num_pages: pages, page_size: 4, session_ttl: std::time::Duration::from_secs(3600) });
        let mut s = SchedulerState::with_memory(m.clone(), mem, cfg, None);
        let mut rng = caracal_kernels::sampling::Rng::new(seed);
        let bases: Vec<Vec<u32>> = (0..3).map(|b| (0..40).map(|j| 10 + ((b * 97 + j * 31) % 400) as u32).collect()).collect();
        let mut receivers: Vec<Option<mpsc::Receiver<TokenEvent>>> = Vec::new();
        let total = 180;
        let mut submitted = 0;
        let mut guard = 0;
        while submitted < total || s.has_work() {
            guard += 1;
            prop_assert!(guard < 20_000, "scheduler made no progress");
            if submitted < total && rng.next_u64().is_multiple_of(3) {
                let base = &bases[(rng.next_u64() % 3) as usize];
                let keep = 1 + (rng.next_u64() % 30) as usize;
                let mut prompt = base[..keep].to_vec();
                prompt.extend((0..rng.next_u64() % 6).map(|_| 10 + (rng.next_u64() % 400) as u32));
                let (tx, rx) = mpsc::channel(4);
                let req = greedy(prompt, 1 + (rng.next_u64() % 8) as usize, None);
                if s.enqueue(req, tx).is_ok() {
                    receivers.push(Some(rx));
                }
                submitted += 1;
            }
            // Clients: read everything, sometimes hang up mid-stream.
            for slot in receivers.iter_mut() {
                if let Some(rx) = slot {
                    while rx.try_recv().is_ok() {}
                    if rng.next_u64().is_multiple_of(40) {
                        *slot = None;
                    }
                }
            }
            s.step();
        }
        s.memory().check_quiescent().map_err(TestCaseError::fail)?;
        prop_assert_eq!(s.stats().running, 0);
    }
}

/// Media spans replace placeholder embeddings: a prompt whose placeholders
/// carry the embedding rows of other tokens generates exactly what those
/// tokens generate, across prefill chunks that split the span, and the
/// span's content key (not its placeholder ids) decides cache hits.
#[test]
fn media_rows_stand_for_their_tokens_through_the_scheduler() {
    use caracal::checkpoint::Checkpoint;
    use caracal_actors::engine::EmbedSpan;
    let dir = fixture("tiny-kimi-linear");
    let m = model("tiny-kimi-linear");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let hidden = config["hidden_size"].as_u64().unwrap() as usize;
    let vocab = m.info().vocab_size;
    let table = Checkpoint::open(&dir)
        .unwrap()
        .matrix("model.embed_tokens.weight", vocab, hidden)
        .unwrap();
    let text: Vec<u32> = (0..30u32).map(|j| 20 + (j * 37) % 300).collect();
    let (at, n) = (6usize, 17usize);
    let mut rows = vec![0.0f32; n * hidden];
    for (i, &t) in text[at..at + n].iter().enumerate() {
        table.row_f32(t as usize, &mut rows[i * hidden..(i + 1) * hidden]);
    }
    let rows: Arc<[f32]> = Arc::from(rows);
    let placeholder = 3u32;
    let with_media = |hash: u64| {
        let mut prompt = text.clone();
        prompt[at..at + n].fill(placeholder);
        let mut key: Vec<u64> = prompt.iter().map(|&t| u64::from(t)).collect();
        for (i, k) in key[at..at + n].iter_mut().enumerate() {
            *k = (1 << 63) | (hash << 8) | i as u64;
        }
        let mut r = greedy(prompt, 8, Some("s"));
        r.cache_key = Some(key);
        r.media = vec![EmbedSpan {
            offset: at,
            rows: rows.clone(),
            first_row: 0,
            len: n,
        }];
        r
    };
    let want = reference(m.as_ref(), &text, 8);
    let (first, again, other) = actix::System::new().block_on(async {
        let engine = Engine::start(m.clone(), small_pages(), None);
        let first = collect(engine.submit(with_media(7)).await.unwrap()).await;
        let again = collect(engine.submit(with_media(7)).await.unwrap()).await;
        let other = collect(engine.submit(with_media(8)).await.unwrap()).await;
        (first, again, other)
    });
    assert_eq!(
        first.ids, want,
        "chunked prefill of 7 splits the 17-row span"
    );
    assert_eq!(again.ids, want);
    assert!(
        again.cached > at + n,
        "the same media hits the cache: {again:?}"
    );
    assert!(
        other.cached <= at,
        "other media misses at its span: {other:?}"
    );
    // A span without a content key, or outside the prompt, is refused.
    actix::System::new().block_on(async {
        let engine = Engine::start(m.clone(), small_pages(), None);
        let mut bad = with_media(1);
        bad.cache_key = None;
        assert!(matches!(
            engine.submit(bad).await,
            Err(SubmitError::Invalid(_))
        ));
        let mut bad = with_media(1);
        bad.media[0].offset = 20;
        assert!(matches!(
            engine.submit(bad).await,
            Err(SubmitError::Invalid(_))
        ));
    });
}

/// bf16 KV rows (`--kv-cache-dtype bf16`, the server default) give the same
/// next-token distribution as f32 rows within bf16's rounding, in half the
/// bytes per page; int8 rows (`--kv-cache-dtype int8`) within int8's, in
/// about half of bf16's bytes.
#[test]
fn bf16_and_int8_kv_rows_match_f32_rows_within_rounding_in_fewer_bytes() {
    use caracal_kernels::paged::KvDtype;
    for name in ["tiny-llama", "tiny-deepseek-v3", "tiny-kimi-linear"] {
        let m = model(name);
        let budget = 8 << 20;
        let f32_pages = caracal_actors::runtime::pages_for(m.as_ref(), budget, 4, KvDtype::F32);
        let bf16_pages = caracal_actors::runtime::pages_for(m.as_ref(), budget, 4, KvDtype::Bf16);
        assert_eq!(bf16_pages, 2 * f32_pages, "{name}");
        let info = m.info();
        let int8_pages = caracal_actors::runtime::pages_for(m.as_ref(), budget, 4, KvDtype::Int8);
        let int8_row = info.kv_width + 4 * info.kv_width / info.kv_segment;
        assert_eq!(
            int8_pages,
            budget / (4 * info.kv_layers * int8_row),
            "{name}"
        );
        // (The tiny models' heads are narrow, so their scales weigh more
        // than SmolLM2's 4 bytes per 64 values.)
        assert!(
            int8_pages > bf16_pages,
            "{name}: {int8_pages} vs {bf16_pages}"
        );
        let first = |dtype: KvDtype| {
            let mut cfg = small_pages();
            cfg.scheduler.kv_cache_dtype = dtype;
            actix::System::new().block_on(async {
                let engine = Engine::start(m.clone(), cfg, None);
                let mut req = greedy(prompts()[5].clone(), 1, None);
                req.logprobs = Some(5);
                let mut rx = engine.submit(req).await.unwrap();
                loop {
                    match rx.recv().await {
                        Some(TokenEvent::Token {
                            logprob: Some(lp), ..
                        }) => break *lp,
                        Some(TokenEvent::Error { kind, message }) => panic!("{kind}: {message}"),
                        Some(_) => {}
                        None => panic!("no token"),
                    }
                }
            })
        };
        let a = first(KvDtype::F32);
        // Tolerance: bf16 keeps 8 mantissa bits of each K/V value, int8 a
        // step of max|x|/127 per head; over these short prompts the
        // log-probabilities move by well under 0.05 (measured: at most
        // 0.017 for int8, 0.014 for bf16).
        for dtype in [KvDtype::Bf16, KvDtype::Int8] {
            let b = first(dtype);
            for ((_, la), (_, lb)) in a.top.iter().zip(&b.top).take(3) {
                assert!((la - lb).abs() < 5e-2, "{name} {dtype:?}: {la} vs {lb}");
            }
            if a.top[0].1 - a.top[1].1 > 0.1 {
                assert_eq!(
                    a.top[0].0, b.top[0].0,
                    "{name} {dtype:?}: a clear top-1 stays"
                );
            }
        }
    }
}
