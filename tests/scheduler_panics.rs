//! Panic isolation in the scheduler, with real tiny models behind a fault
//! injector: [`PanicsOnToken`] delegates every forward to the fixture model
//! and then panics when the batch carried a chosen token id (after the
//! model has advanced the states and written KV rows, as a bug deep in a
//! layer would).
//!
//! On an attention model the request that carries the token ends with
//! `internal_error`, the request batched with it completes with exactly
//! the tokens it gives alone, every page comes back, the panic is counted,
//! and later requests run. On a hybrid (KDA) model, whose recurrent states
//! cannot be rolled back, every request of the panicking step fails and the
//! scheduler goes on serving. A panic outside the forward (here in
//! admission, from [`PanicsOnNewState`]) fails every request the scheduler
//! holds and the engine's thread lives on. Through the gateway, the victim gets a 500
//! `internal_error`, `/metrics` counts the panic in `caracal_panics_total`,
//! and the next request is answered.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use caracal::generate::LoadedModel;
use caracal_actors::engine::{CausalLm, EngineError, ModelInfo, SeqBatch, SeqState};
use caracal_actors::messages::{ErrorKind, StopConditions, TokenEvent, ValidRequest};
use caracal_actors::scheduler::{SchedulerConfig, SchedulerState, StepOutcome};
use caracal_kernels::paged::KvPool;
use caracal_kernels::sampling::SamplingParams;
use tokio::sync::mpsc;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// The fault injector: a real model whose forward panics, after running,
/// when any sequence of the batch feeds `token`.
struct PanicsOnToken {
    /// The fixture model every call goes to.
    inner: Arc<dyn CausalLm>,
    /// The id that triggers the panic.
    token: u32,
}

impl CausalLm for PanicsOnToken {
    fn info(&self) -> &ModelInfo {
        self.inner.info()
    }

    fn new_state(&self) -> SeqState {
        self.inner.new_state()
    }

    fn forward(
        &self,
        cache: &mut KvPool,
        batch: &mut [SeqBatch<'_>],
    ) -> Result<Vec<f32>, EngineError> {
        let out = self.inner.forward(cache, batch);
        if batch.iter().any(|b| b.tokens.contains(&self.token)) {
            panic!("injected fault: token {} in the batch", self.token);
        }
        out
    }
}

/// A real model whose `new_state` (called when a request is admitted)
/// panics while `armed`: a panic outside the forward.
struct PanicsOnNewState {
    /// The fixture model every call goes to.
    inner: Arc<dyn CausalLm>,
    /// Whether the next admissions panic.
    armed: std::sync::atomic::AtomicBool,
}

impl CausalLm for PanicsOnNewState {
    fn info(&self) -> &ModelInfo {
        self.inner.info()
    }

    fn new_state(&self) -> SeqState {
        if self.armed.load(std::sync::atomic::Ordering::SeqCst) {
            panic!("injected fault: admission");
        }
        self.inner.new_state()
    }

    fn forward(
        &self,
        cache: &mut KvPool,
        batch: &mut [SeqBatch<'_>],
    ) -> Result<Vec<f32>, EngineError> {
        self.inner.forward(cache, batch)
    }
}

fn load(name: &str) -> Arc<dyn CausalLm> {
    Arc::from(
        LoadedModel::load(&fixture(name))
            .expect("fixture loads")
            .model,
    )
}

fn greedy(prompt: Vec<u32>, max_tokens: usize) -> ValidRequest {
    ValidRequest {
        session: None,
        prompt,
        cache_key: None,
        max_tokens,
        sampling: SamplingParams::greedy(),
        stop: StopConditions::default(),
        ..Default::default()
    }
}

/// How a stream ended: its tokens and `Ok(())` or the error kind and message.
type Outcome = (Vec<u32>, Result<(), (ErrorKind, String)>);

/// Everything a finished stream carried (the scheduler has stepped it to the end).
fn drain(rx: &mut mpsc::Receiver<TokenEvent>) -> Outcome {
    let mut ids = Vec::new();
    while let Ok(ev) = rx.try_recv() {
        match ev {
            TokenEvent::Token { id, .. } => ids.push(id),
            TokenEvent::Finished { .. } => return (ids, Ok(())),
            TokenEvent::Error { kind, message } => return (ids, Err((kind, message))),
        }
    }
    panic!("the stream has no final event after {} tokens", ids.len());
}

/// A scheduler over `model` with 16-token pages and room for a few sequences.
fn scheduler(model: Arc<dyn CausalLm>) -> SchedulerState {
    SchedulerState::new(
        model,
        64,
        SchedulerConfig {
            page_size: 16,
            ..Default::default()
        },
        None,
    )
}

/// Steps until nothing is left to do.
fn run_to_idle(s: &mut SchedulerState) {
    for _ in 0..10_000 {
        if s.step() == StepOutcome::Idle {
            return;
        }
    }
    panic!("the scheduler never became idle");
}

/// Runs each request to its end on a fresh scheduler, all queued at once
/// (so the first step batches every prompt), and returns the outcomes.
fn run_together(s: &mut SchedulerState, reqs: Vec<ValidRequest>) -> Vec<Outcome> {
    let mut rxs: Vec<_> = reqs
        .into_iter()
        .map(|r| {
            let (tx, rx) = mpsc::channel(1024);
            s.enqueue(r, tx).expect("queued");
            rx
        })
        .collect();
    run_to_idle(s);
    rxs.iter_mut().map(drain).collect()
}

/// No sequence runs, nothing is locked, every page is free or cached.
fn assert_pages_back(s: &SchedulerState) {
    let m = s.memory_stats();
    assert_eq!(s.stats().running, 0);
    assert_eq!(
        m.cached_pages, m.evictable_pages,
        "no page stays locked: {m:?}"
    );
    assert_eq!(m.free_pages + m.cached_pages, m.total_pages, "{m:?}");
    assert_eq!(m.pinned_sessions, 0, "{m:?}");
}

const BYSTANDER: [u32; 7] = [40, 41, 42, 43, 44, 45, 46];

/// A token the bystander neither reads nor writes when it runs alone.
fn poison_for(alone: &[u32]) -> u32 {
    (100..500)
        .find(|t| !alone.contains(t) && !BYSTANDER.contains(t))
        .expect("a free id")
}

#[test]
fn a_panicking_forward_fails_only_its_request_on_an_attention_model() {
    let inner = load("tiny-llama");
    let mut alone = scheduler(inner.clone());
    let (alone_ids, end) = run_together(&mut alone, vec![greedy(BYSTANDER.to_vec(), 24)]).remove(0);
    assert_eq!(end, Ok(()));
    assert!(alone_ids.len() > 4, "{alone_ids:?}");
    let cached_alone = alone.memory_stats().cached_pages;
    let poison = poison_for(&alone_ids);

    let model = Arc::new(PanicsOnToken {
        inner,
        token: poison,
    });
    let mut s = scheduler(model);
    let total = s.memory_stats().total_pages;
    assert_eq!(s.memory_stats().free_pages, total);
    let out = run_together(
        &mut s,
        vec![
            greedy(BYSTANDER.to_vec(), 24),
            greedy(vec![7, 8, poison, 9, 10], 24),
        ],
    );
    let (bystander, victim) = (&out[0], &out[1]);
    assert_eq!(bystander.1, Ok(()), "the bystander completes");
    assert_eq!(
        bystander.0, alone_ids,
        "the bystander's greedy tokens equal its run alone"
    );
    let (kind, message) = victim.1.clone().expect_err("the victim fails");
    assert_eq!(kind, ErrorKind::InternalError);
    assert!(
        message.contains("injected fault") && message.contains("panic"),
        "the message names the panic: {message}"
    );
    assert!(victim.0.is_empty(), "the victim produced no token");
    // The batched forward panicked, then the victim alone again.
    assert_eq!(s.stats().panics, 2, "{:?}", s.stats());
    assert_eq!(s.stats().finished, 1);
    assert_pages_back(&s);
    assert_eq!(
        s.memory_stats().cached_pages,
        cached_alone,
        "the victim cached nothing: the same pages are cached as by the bystander alone"
    );

    // The scheduler goes on: a later request runs (and hits the cache).
    let (later, end) = run_together(&mut s, vec![greedy(BYSTANDER.to_vec(), 24)]).remove(0);
    assert_eq!(end, Ok(()));
    assert_eq!(later, alone_ids);
    // A victim that panics in decode, not prefill: the first generated id
    // it has not seen before poisons the step that feeds it back.
    let k = (1..alone_ids.len())
        .find(|&k| !BYSTANDER.contains(&alone_ids[k]) && !alone_ids[..k].contains(&alone_ids[k]))
        .expect("a fresh id among the generated ones");
    let decode_victim = Arc::new(PanicsOnToken {
        inner: load("tiny-llama"),
        token: alone_ids[k],
    });
    let mut s = scheduler(decode_victim);
    let (ids, end) = run_together(&mut s, vec![greedy(BYSTANDER.to_vec(), 24)]).remove(0);
    assert_eq!(
        ids,
        alone_ids[..=k].to_vec(),
        "tokens up to the poisoned one were streamed"
    );
    assert_eq!(end.map_err(|e| e.0), Err(ErrorKind::InternalError));
    assert_pages_back(&s);
}

#[test]
fn a_panicking_forward_on_a_hybrid_model_fails_its_step_and_the_scheduler_goes_on() {
    let inner = load("tiny-kimi-linear");
    let mut alone = scheduler(inner.clone());
    let (alone_ids, end) = run_together(&mut alone, vec![greedy(BYSTANDER.to_vec(), 12)]).remove(0);
    assert_eq!(end, Ok(()));
    let poison = poison_for(&alone_ids);
    let mut s = scheduler(Arc::new(PanicsOnToken {
        inner,
        token: poison,
    }));
    let out = run_together(
        &mut s,
        vec![
            greedy(BYSTANDER.to_vec(), 12),
            greedy(vec![7, poison, 9], 12),
        ],
    );
    for (ids, end) in &out {
        assert!(ids.is_empty());
        let (kind, message) = end.clone().expect_err("both fail");
        assert_eq!(kind, ErrorKind::InternalError);
        assert!(message.contains("injected fault"), "{message}");
    }
    assert_eq!(s.stats().panics, 1);
    assert_pages_back(&s);
    let (later, end) = run_together(&mut s, vec![greedy(BYSTANDER.to_vec(), 12)]).remove(0);
    assert_eq!(end, Ok(()));
    assert_eq!(later, alone_ids, "a later request runs as it does alone");
    assert_pages_back(&s);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_answers_a_panic_with_internal_error_and_counts_it() {
    use caracal::gateway::{EngineHost, Gateway, GatewayConfig, ServedModel};
    use caracal::text::tokenizer::TextTokenizer;
    use http_body_util::{BodyExt, Full};
    use hyper::body::Bytes;
    use hyper_util::rt::TokioIo;

    let dir = fixture("tiny-llama");
    let poison = 300;
    let model: Arc<dyn CausalLm> = Arc::new(PanicsOnToken {
        inner: load("tiny-llama"),
        token: poison,
    });
    let tokenizer = Arc::new(TextTokenizer::from_dir(&dir).expect("tokenizer"));
    let served = ServedModel::new("tiny-llama", model.as_ref(), Some(tokenizer.clone()), false);
    let detok = Some(tokenizer as Arc<dyn caracal_actors::engine::Detokenize>);
    let host = EngineHost::start(model, Default::default(), detok).expect("engine starts");
    let gateway = Gateway::new(served, host, GatewayConfig::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(gateway.serve(listener, async move {
        let _ = stopped.await;
    }));

    let request = |method: &'static str, path: &'static str, body: Option<serde_json::Value>| async move {
        let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .expect("handshake");
        tokio::spawn(conn);
        let req = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", addr.to_string())
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(
                body.map(|b| b.to_string()).unwrap_or_default(),
            )))
            .expect("request");
        let resp = sender.send_request(req).await.expect("answer");
        let status = resp.status().as_u16();
        let bytes = resp.into_body().collect().await.expect("body").to_bytes();
        (status, String::from_utf8_lossy(&bytes).into_owned())
    };
    let body = |prompt: Vec<u32>| {
        Some(
            serde_json::json!({"model": "tiny-llama", "prompt": prompt, "max_tokens": 4, "temperature": 0}),
        )
    };
    let (status, text) = request("POST", "/v1/completions", body(vec![5, poison, 6])).await;
    assert_eq!(status, 500, "{text}");
    let err: serde_json::Value = serde_json::from_str(&text).expect("JSON error");
    assert!(
        err["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("injected fault")),
        "{err}"
    );
    let (status, text) = request("POST", "/v1/completions", body(vec![5, 6, 7])).await;
    assert_eq!(status, 200, "the next request is served: {text}");
    let (_, metrics) = request("GET", "/metrics", None).await;
    assert!(
        metrics.contains("# TYPE caracal_panics_total counter\ncaracal_panics_total 1\n"),
        "{metrics}"
    );
    let _ = stop.send(());
    server.await.expect("serve task").expect("serve returns");
}

#[test]
fn a_panic_outside_the_forward_fails_the_held_requests_and_the_engine_lives() {
    use caracal_actors::runtime::{Engine, EngineConfig};
    use std::sync::atomic::Ordering;

    let inner = load("tiny-llama");
    let mut alone = scheduler(inner.clone());
    let (alone_ids, _) = run_together(&mut alone, vec![greedy(BYSTANDER.to_vec(), 8)]).remove(0);
    let model = Arc::new(PanicsOnNewState {
        inner,
        armed: true.into(),
    });
    let engine = Engine::start(model.clone(), EngineConfig::default(), None);
    // `None`: the stream closed without a final event.
    let read = |mut rx: mpsc::Receiver<TokenEvent>| {
        let mut ids = Vec::new();
        while let Some(ev) = rx.blocking_recv() {
            match ev {
                TokenEvent::Token { id, .. } => ids.push(id),
                TokenEvent::Finished { .. } => return (ids, Some(Ok(()))),
                TokenEvent::Error { kind, message } => return (ids, Some(Err((kind, message)))),
            }
        }
        (ids, None)
    };
    let victim = engine.try_submit(greedy(vec![3, 4, 5], 8)).expect("queued");
    let (ids, end) = read(victim.events);
    assert!(ids.is_empty());
    // The request was out of the queue and not yet running when admission
    // panicked: its stream ends (the gateway answers that with
    // internal_error); a request still held would get internal_error here.
    match end {
        None => {}
        Some(Err((kind, message))) => {
            assert_eq!(kind, ErrorKind::InternalError);
            assert!(message.contains("injected fault: admission"), "{message}");
        }
        Some(Ok(())) => panic!("the victim finished"),
    }

    model.armed.store(false, Ordering::SeqCst);
    let later = engine
        .try_submit(greedy(BYSTANDER.to_vec(), 8))
        .expect("queued");
    let (ids, end) = read(later.events);
    assert_eq!(end, Some(Ok(())), "the engine's thread still serves");
    assert_eq!(ids, alone_ids);
    let stats = engine.stats().expect("the scheduler answers");
    assert_eq!(stats.scheduler.panics, 1);
    assert_eq!(stats.scheduler.running, 0);
    assert_eq!(
        stats.scheduler.waiting, 0,
        "the refused request gave its slot back"
    );
    let m = stats.memory;
    assert_eq!(m.cached_pages, m.evictable_pages, "{m:?}");
    assert_eq!(m.free_pages + m.cached_pages, m.total_pages, "{m:?}");
}
