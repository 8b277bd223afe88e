//! The scheduler with a small deterministic model (`common::CountingLm`):
//! admission while a forward runs (ordered by a barrier in the model, not
//! by timing), the bounded queue, cancellation by id, session close on a
//! running engine, the step plan, final events for slow clients, stop
//! strings, and no page or lock leaked under memory pressure.

mod common;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use caracal_actors::engine::{CausalLm, Detokenize};
use caracal_actors::messages::{ErrorKind, FinishReason, SubmitError, TokenEvent};
use caracal_actors::runtime::{Engine, EngineConfig};
use caracal_actors::scheduler::{SchedulerConfig, SchedulerState, StepOutcome, Work};
use caracal_kernels::sampling::Rng;
use common::{expected, greedy, CountingLm, ForwardGate, Letters, POISON};
use tokio::sync::mpsc;

/// How a stream ended.
#[derive(Debug, Clone, PartialEq)]
enum End {
    Finished(FinishReason),
    Error(ErrorKind),
    Closed,
}

/// Everything one stream carried.
#[derive(Debug, Clone, PartialEq)]
struct Stream {
    ids: Vec<u32>,
    end: End,
    cached: usize,
}

/// Reads a stream to its end (blocking; no async runtime needed).
fn read_all(mut rx: mpsc::Receiver<TokenEvent>) -> Stream {
    let mut ids = Vec::new();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            TokenEvent::Token { id, .. } => ids.push(id),
            TokenEvent::Finished { reason, cache, .. } => {
                return Stream {
                    ids,
                    end: End::Finished(reason),
                    cached: cache.cached_tokens,
                }
            }
            TokenEvent::Error { kind, .. } => {
                return Stream {
                    ids,
                    end: End::Error(kind),
                    cached: 0,
                }
            }
        }
    }
    Stream {
        ids,
        end: End::Closed,
        cached: 0,
    }
}

/// Reads what is already there without waiting.
fn read_ready(rx: &mut mpsc::Receiver<TokenEvent>) -> Vec<TokenEvent> {
    std::iter::from_fn(|| rx.try_recv().ok()).collect()
}

/// An engine config with 4-token pages and a pool of `pages` pages.
fn engine_cfg(pages: usize) -> EngineConfig {
    EngineConfig {
        scheduler: SchedulerConfig {
            page_size: 4,
            state_checkpoint_interval: 8,
            chunked_prefill_size: 6,
            ..Default::default()
        },
        // CountingLm: one KV layer of width 1 → 4 tokens · 4 bytes per page.
        kv_cache_memory: pages * 16,
        session_ttl: Duration::from_secs(3600),
        ..Default::default()
    }
}

/// True once in `n` draws.
fn one_in(rng: &mut Rng, n: u64) -> bool {
    rng.next_u64().is_multiple_of(n)
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a current-thread runtime")
        .block_on(f)
}

#[test]
fn admission_completes_while_a_forward_is_running() {
    let gate = ForwardGate::armed();
    let model = Arc::new(CountingLm::gated(gate.clone()));
    let engine = Engine::start(model.clone(), engine_cfg(64), None);
    let a = engine.try_submit(greedy(vec![1, 2, 3], 5, None)).unwrap();
    gate.wait_until_running();
    // The first forward is held inside the model: submitting must not wait for it.
    let b = engine
        .try_submit(greedy(vec![4, 5], 5, None))
        .expect("admission does not wait for the running forward");
    assert_ne!(a.id, b.id);
    let stats = engine
        .stats()
        .expect("counters are answered while a forward runs");
    assert_eq!(stats.scheduler.waiting, 1, "{stats:?}");
    assert_eq!(stats.memory.total_pages, 64);
    assert_eq!(model.forwards.load(std::sync::atomic::Ordering::SeqCst), 1);
    gate.release();
    let (a, b) = (read_all(a.events), read_all(b.events));
    assert_eq!(a.ids, expected(&[1, 2, 3], 5));
    assert_eq!(b.ids, expected(&[4, 5], 5));
    assert_eq!(b.end, End::Finished(FinishReason::Length));
}

#[test]
fn full_queue_is_refused_at_once_while_a_forward_runs() {
    let gate = ForwardGate::armed();
    let model = Arc::new(CountingLm::gated(gate.clone()));
    let mut cfg = engine_cfg(64);
    cfg.scheduler.max_waiting_requests = 3;
    let engine = Engine::start(model, cfg, None);
    let first = engine.try_submit(greedy(vec![1, 2, 3], 2, None)).unwrap();
    gate.wait_until_running();
    let queued: Vec<_> = (0..3)
        .map(|i| engine.try_submit(greedy(vec![7, i], 2, None)).unwrap())
        .collect();
    let err = engine
        .try_submit(greedy(vec![9, 9], 2, None))
        .expect_err("the queue is full");
    assert_eq!(
        err,
        SubmitError::Overloaded {
            waiting: 3,
            limit: 3
        }
    );
    assert_eq!(err.kind(), ErrorKind::Overloaded);
    gate.release();
    assert_eq!(read_all(first.events).ids, expected(&[1, 2, 3], 2));
    for (i, q) in queued.into_iter().enumerate() {
        assert_eq!(read_all(q.events).ids, expected(&[7, i as u32], 2));
    }
    engine
        .try_submit(greedy(vec![9, 9], 2, None))
        .expect("slots came back when the queued requests were admitted");
}

#[test]
fn queued_submission_waits_for_a_slot_instead_of_being_refused() {
    let gate = ForwardGate::armed();
    let model = Arc::new(CountingLm::gated(gate.clone()));
    let mut cfg = engine_cfg(64);
    cfg.scheduler.max_waiting_requests = 1;
    let engine = Engine::start(model, cfg, None);
    let first = engine.try_submit(greedy(vec![1, 2], 2, None)).unwrap();
    gate.wait_until_running();
    let second = engine.try_submit(greedy(vec![3, 4], 2, None)).unwrap();
    assert!(matches!(
        engine.try_submit(greedy(vec![5, 6], 2, None)),
        Err(SubmitError::Overloaded { .. })
    ));
    let third = block_on(async {
        let mut queued = std::pin::pin!(engine.submit_queued(greedy(vec![5, 6], 2, None)));
        let polled = std::future::poll_fn(|cx| std::task::Poll::Ready(queued.as_mut().poll(cx)));
        assert!(polled.await.is_pending(), "the queue is full: it must wait");
        gate.release();
        queued
            .await
            .expect("a slot frees once the scheduler admits")
    });
    assert_eq!(read_all(first.events).ids, expected(&[1, 2], 2));
    assert_eq!(read_all(second.events).ids, expected(&[3, 4], 2));
    assert_eq!(read_all(third.events).ids, expected(&[5, 6], 2));
}

#[test]
fn cancel_by_id_stops_a_running_request_and_caches_nothing() {
    let engine = Engine::start(Arc::new(CountingLm::new(false)), engine_cfg(128), None);
    let mut sub = engine.try_submit(greedy(vec![5, 6, 7], 300, None)).unwrap();
    assert!(matches!(
        sub.events.blocking_recv(),
        Some(TokenEvent::Token { .. })
    ));
    block_on(engine.cancel(sub.id)).unwrap();
    let rest = read_all(sub.events);
    assert_eq!(rest.end, End::Error(ErrorKind::Cancelled));
    assert!(rest.ids.len() < 299, "kept decoding after the cancel");
    let stats = engine.stats().unwrap();
    assert_eq!(stats.scheduler.running, 0);
    assert_eq!(stats.scheduler.cancelled, 1);
    assert_eq!(stats.memory.cached_pages, 0, "{stats:?}");
    assert_eq!(stats.memory.free_pages, stats.memory.total_pages);
}

#[test]
fn closed_session_is_unpinned_on_a_running_engine() {
    let engine = Engine::start(Arc::new(CountingLm::new(false)), engine_cfg(64), None);
    let turn = read_all(
        engine
            .try_submit(greedy((1..14).collect(), 3, Some("agent")))
            .unwrap()
            .events,
    );
    assert_eq!(turn.end, End::Finished(FinishReason::Length));
    let mem = engine.stats().unwrap().memory;
    assert_eq!(mem.pinned_sessions, 1);
    assert!(
        mem.evictable_pages < mem.cached_pages,
        "the pin locks: {mem:?}"
    );
    block_on(engine.close_session("agent")).unwrap();
    // Commands are applied in order: once this one finishes, the close was applied.
    let probe = read_all(
        engine
            .try_submit(greedy(vec![40, 41], 1, None))
            .unwrap()
            .events,
    );
    assert_eq!(probe.end, End::Finished(FinishReason::Length));
    let mem = engine.stats().unwrap().memory;
    assert_eq!(mem.pinned_sessions, 0);
    assert_eq!(mem.evictable_pages, mem.cached_pages, "{mem:?}");
}

#[test]
fn closing_a_session_cancels_its_running_requests() {
    let engine = Engine::start(Arc::new(CountingLm::new(false)), engine_cfg(128), None);
    let mut sub = engine
        .try_submit(greedy(vec![3, 4, 5], 300, Some("gone")))
        .unwrap();
    let other = engine
        .try_submit(greedy(vec![8, 9], 20, Some("stays")))
        .unwrap();
    assert!(matches!(
        sub.events.blocking_recv(),
        Some(TokenEvent::Token { .. })
    ));
    block_on(engine.close_session("gone")).unwrap();
    assert_eq!(read_all(sub.events).end, End::Error(ErrorKind::Cancelled));
    assert_eq!(read_all(other.events).ids, expected(&[8, 9], 20));
    let stats = engine.stats().unwrap();
    assert_eq!(stats.scheduler.running, 0);
    assert_eq!(stats.memory.pinned_sessions, 1, "only `stays` is pinned");
}

#[test]
fn dropping_the_engine_ends_its_streams() {
    let engine = Engine::start(Arc::new(CountingLm::new(false)), engine_cfg(128), None);
    let sub = engine.try_submit(greedy(vec![1, 2], 400, None)).unwrap();
    drop(engine);
    let s = read_all(sub.events);
    assert_eq!(s.end, End::Closed);
}

/// Under a tiny page pool, many requests with shared prefixes, sessions,
/// cancellations by id, hang-ups and session closes: every stream ends as
/// it should, and afterwards every page is free and no radix node locked.
#[test]
fn memory_pressure_leaks_no_page_or_lock() {
    const PAGES: usize = 24;
    let model = Arc::new(CountingLm::new(false));
    let mut cfg = engine_cfg(PAGES);
    cfg.scheduler.max_running_requests = 4;
    cfg.scheduler.max_batch_tokens = 16;
    cfg.scheduler.max_waiting_requests = 8;
    cfg.stream_credit = 2;
    let engine = Engine::start(model, cfg, None);
    assert_eq!(engine.stats().unwrap().memory.total_pages, PAGES);
    let mut rng = Rng::new(7);
    let bases: Vec<Vec<u32>> = (0..3)
        .map(|b| {
            (0..40)
                .map(|j| 1 + ((b * 17 + j * 13) % 58) as u32)
                .collect()
        })
        .collect();
    let (mut finished, mut refused) = (0, 0);
    for _burst in 0..16 {
        let mut readers = Vec::new();
        for _ in 0..12 {
            let base = &bases[(rng.next_u64() % 3) as usize];
            let mut prompt = base[..1 + (rng.next_u64() % 24) as usize].to_vec();
            prompt.extend((0..rng.next_u64() % 5).map(|_| 1 + (rng.next_u64() % 58) as u32));
            // Now and then a request that can never get its pages.
            let max_tokens = if one_in(&mut rng, 15) {
                200
            } else {
                1 + (rng.next_u64() % 12) as usize
            };
            let session = match rng.next_u64() % 4 {
                0 => Some("s0"),
                1 => Some("s1"),
                _ => None,
            };
            let hang_up_after = (one_in(&mut rng, 8)).then(|| (rng.next_u64() % 3) as usize);
            match engine.try_submit(greedy(prompt.clone(), max_tokens, session)) {
                Ok(sub) => {
                    let id = sub.id;
                    let reader = std::thread::spawn(move || match hang_up_after {
                        Some(n) => {
                            let mut rx = sub.events;
                            for _ in 0..n {
                                rx.blocking_recv();
                            }
                            None
                        }
                        None => Some(read_all(sub.events)),
                    });
                    readers.push((id, prompt, max_tokens, reader));
                }
                // The waiting queue is bounded; a refusal is a valid answer.
                Err(SubmitError::Overloaded { .. }) => {}
                Err(e) => panic!("unexpected refusal: {e}"),
            }
            if one_in(&mut rng, 10) && !readers.is_empty() {
                let (id, ..) = &readers[(rng.next_u64() % readers.len() as u64) as usize];
                block_on(engine.cancel(*id)).unwrap();
            }
            if one_in(&mut rng, 25) {
                block_on(engine.close_session("s0")).unwrap();
            }
        }
        for (id, prompt, max_tokens, reader) in readers {
            let Some(s) = reader.join().expect("reader thread") else {
                continue;
            };
            match s.end {
                End::Finished(reason) => {
                    assert_eq!(reason, FinishReason::Length);
                    assert_eq!(s.ids, expected(&prompt, max_tokens), "request {id}");
                    finished += 1;
                }
                End::Error(ErrorKind::KvCacheFull) => {
                    assert!(s.ids.is_empty());
                    refused += 1;
                }
                End::Error(ErrorKind::Cancelled) => {
                    assert_eq!(s.ids, expected(&prompt, s.ids.len()), "request {id}");
                }
                other => panic!("request {id} ended with {other:?}"),
            }
        }
    }
    assert!(finished > 50, "only {finished} requests finished");
    assert!(refused > 0, "no request met a full pool");
    block_on(engine.close_session("s0")).unwrap();
    block_on(engine.close_session("s1")).unwrap();
    // A probe that needs the whole pool is admitted only if every cached
    // page can be evicted (none leaked, none locked); cancelling it leaves
    // nothing cached.
    let mut probe = engine
        .try_submit(greedy(vec![0; 8], PAGES * 4 - 8, None))
        .unwrap();
    assert!(
        matches!(probe.events.blocking_recv(), Some(TokenEvent::Token { .. })),
        "the whole pool could not be reserved"
    );
    block_on(engine.cancel(probe.id)).unwrap();
    assert_eq!(read_all(probe.events).end, End::Error(ErrorKind::Cancelled));
    let stats = engine.stats().unwrap();
    assert_eq!(stats.scheduler.running, 0, "{stats:?}");
    assert_eq!(stats.scheduler.waiting, 0, "{stats:?}");
    assert_eq!(stats.memory.pinned_sessions, 0, "{stats:?}");
    assert_eq!(stats.memory.cached_pages, 0, "{stats:?}");
    assert_eq!(
        stats.memory.free_pages, stats.memory.total_pages,
        "{stats:?}"
    );
}

/// The same pressure on the state directly, checked page by page.
#[test]
fn state_under_pressure_is_quiescent_afterwards() {
    for hybrid in [false, true] {
        let model: Arc<dyn CausalLm> = Arc::new(CountingLm::new(hybrid));
        let cfg = SchedulerConfig {
            page_size: 4,
            max_running_requests: 3,
            max_batch_tokens: 12,
            chunked_prefill_size: 5,
            state_checkpoint_interval: 8,
            max_waiting_requests: 1000,
            ..Default::default()
        };
        let mut s = SchedulerState::new(model, 20, cfg, None);
        let mut rng = Rng::new(11 + hybrid as u64);
        let base: Vec<u32> = (0..40).map(|j| 1 + (j * 7 % 58) as u32).collect();
        let mut clients = Vec::new();
        for round in 0..400 {
            if round < 300 && one_in(&mut rng, 2) {
                let mut prompt = base[..1 + (rng.next_u64() % 30) as usize].to_vec();
                prompt.push(1 + (rng.next_u64() % 58) as u32);
                let n = 1 + (rng.next_u64() % 10) as usize;
                let session = (one_in(&mut rng, 3)).then_some("s");
                let (tx, rx) = mpsc::channel(3);
                let id = s.enqueue(greedy(prompt.clone(), n, session), tx).unwrap();
                clients.push((id, prompt, Some(rx), Vec::new()));
            }
            for (id, prompt, slot, ids) in clients.iter_mut() {
                let Some(rx) = slot else { continue };
                for ev in read_ready(rx) {
                    match ev {
                        TokenEvent::Token { id: t, .. } => ids.push(t),
                        TokenEvent::Finished { .. } => {
                            assert_eq!(*ids, expected(prompt, ids.len()), "request {id}");
                            *slot = None;
                            break;
                        }
                        TokenEvent::Error { kind, message } => {
                            assert!(
                                matches!(kind, ErrorKind::Cancelled | ErrorKind::KvCacheFull),
                                "{kind}: {message}"
                            );
                            *slot = None;
                            break;
                        }
                    }
                }
                if slot.is_some() && one_in(&mut rng, 50) {
                    *slot = None; // hang up
                }
            }
            if one_in(&mut rng, 20) && !clients.is_empty() {
                let id = clients[(rng.next_u64() % clients.len() as u64) as usize].0;
                s.cancel(id);
            }
            if one_in(&mut rng, 60) {
                s.close_session("s");
            }
            s.step();
        }
        while s.has_work() {
            for (_, _, slot, _) in clients.iter_mut() {
                if let Some(rx) = slot {
                    read_ready(rx);
                }
            }
            s.step();
        }
        s.close_session("s");
        s.memory().check_quiescent().unwrap();
        assert_eq!(s.memory_stats().pinned_sessions, 0);
        assert_eq!(s.stats().running, 0);
    }
}

#[test]
fn plan_puts_decodes_before_prefill_chunks_within_the_budget() {
    let cfg = SchedulerConfig {
        page_size: 4,
        max_batch_tokens: 8,
        chunked_prefill_size: 5,
        ..Default::default()
    };
    let mut s = SchedulerState::new(Arc::new(CountingLm::new(false)), 64, cfg, None);
    let (tx, mut rx) = mpsc::channel(16);
    s.enqueue(greedy(vec![1, 2, 3], 4, None), tx.clone())
        .unwrap();
    s.enqueue(greedy((1..21).collect(), 4, None), tx).unwrap();
    assert_eq!(s.step(), StepOutcome::Ran);
    assert_eq!(
        s.plan(),
        vec![
            Work::Decode { seq: 0 },
            Work::Prefill {
                seq: 1,
                start: 5,
                len: 5
            },
        ],
        "after prefilling 3 + 5 tokens: the short prompt decodes, the long one goes on"
    );
    assert_eq!(s.stats().prefill_tokens, 8);
    assert_eq!(
        read_ready(&mut rx).len(),
        1,
        "the short prompt's first token"
    );
}

#[test]
fn finished_event_waits_for_a_client_with_no_room() {
    let mut s = SchedulerState::new(
        Arc::new(CountingLm::new(false)),
        16,
        SchedulerConfig {
            page_size: 4,
            ..Default::default()
        },
        None,
    );
    let (tx, mut rx) = mpsc::channel(1);
    s.enqueue(greedy(vec![1, 2, 3], 1, None), tx).unwrap();
    assert_eq!(s.step(), StepOutcome::Ran);
    assert_eq!(s.stats().finished, 1);
    assert_eq!(
        s.step(),
        StepOutcome::Paused,
        "the Finished event is still owed"
    );
    assert!(matches!(rx.try_recv(), Ok(TokenEvent::Token { .. })));
    assert_eq!(s.step(), StepOutcome::Idle);
    assert!(matches!(rx.try_recv(), Ok(TokenEvent::Finished { .. })));
    s.memory().check_quiescent().unwrap();
}

#[test]
fn failed_forward_fails_its_batch_and_frees_their_pages() {
    let mut s = SchedulerState::new(
        Arc::new(CountingLm::new(false)),
        16,
        SchedulerConfig {
            page_size: 4,
            ..Default::default()
        },
        None,
    );
    let (tx, mut rx) = mpsc::channel(8);
    s.enqueue(greedy(vec![1, POISON, 3], 3, None), tx.clone())
        .unwrap();
    s.enqueue(greedy(vec![4, 5], 3, None), tx).unwrap();
    s.step();
    let events = read_ready(&mut rx);
    assert_eq!(events.len(), 2, "{events:?}");
    assert!(events.iter().all(|e| matches!(
        e,
        TokenEvent::Error {
            kind: ErrorKind::InternalError,
            ..
        }
    )));
    assert!(!s.has_work());
    s.memory().check_quiescent().unwrap();
    assert_eq!(s.memory_stats().free_pages, 16);
}

#[test]
fn stop_string_ends_the_request_on_the_token_that_completes_it() {
    let prompt = vec![1, 2, 3];
    let want = expected(&prompt, 12);
    let text = Letters.decode(&want);
    // A stop string made of tokens 5..8 of the output (first occurrence).
    let stop = text[5..8].to_string();
    let first = (1..=want.len())
        .find(|&n| Letters.decode(&want[..n]).contains(&stop))
        .unwrap();
    let mut s = SchedulerState::new(
        Arc::new(CountingLm::new(false)),
        16,
        SchedulerConfig {
            page_size: 4,
            ..Default::default()
        },
        Some(Arc::new(Letters)),
    );
    let (tx, rx) = mpsc::channel(32);
    let mut req = greedy(prompt, 12, None);
    req.stop.strings = vec![stop, "zzzzzz".into()];
    s.enqueue(req, tx).unwrap();
    while s.has_work() {
        s.step();
    }
    let out = read_all(rx);
    assert_eq!(out.end, End::Finished(FinishReason::Stop));
    assert_eq!(out.ids, want[..first].to_vec());
}

#[test]
fn hybrid_follow_up_turn_restores_the_snapshot_it_hit() {
    let model: Arc<dyn CausalLm> = Arc::new(CountingLm::new(true));
    let mut s = SchedulerState::new(
        model,
        64,
        SchedulerConfig {
            page_size: 4,
            state_checkpoint_interval: 8,
            chunked_prefill_size: 5,
            ..Default::default()
        },
        None,
    );
    let turn1: Vec<u32> = (1..20).collect();
    let (tx, rx) = mpsc::channel(32);
    s.enqueue(greedy(turn1.clone(), 6, Some("a")), tx).unwrap();
    while s.has_work() {
        s.step();
    }
    let first = read_all(rx);
    let mut turn2 = turn1.clone();
    turn2.extend(&first.ids);
    turn2.extend([7, 8, 9]);
    let (tx, rx) = mpsc::channel(32);
    s.enqueue(greedy(turn2.clone(), 6, Some("a")), tx).unwrap();
    while s.has_work() {
        s.step();
    }
    let second = read_all(rx);
    assert!(
        second.cached > 0 && second.cached.is_multiple_of(4),
        "{second:?}"
    );
    // The model errors when its recurrent state disagrees with the KV rows.
    assert_eq!(second.end, End::Finished(FinishReason::Length));
    assert_eq!(second.ids, expected(&turn2, 6));
}
