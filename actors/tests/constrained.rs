//! Constrained sequences in the scheduler, with the deterministic
//! `common::CountingLm`: the grammar's mask is obeyed, a grammar that fails
//! ends only its own sequence (`constraint_violation`), a complete grammar
//! ends with `stop`, and jump-forward produces the same ids in fewer steps.

mod common;

use std::sync::Arc;

use caracal_actors::constraint::{Constraint, ConstraintError, SeqConstraint, TokenMask};
use caracal_actors::messages::{ErrorKind, FinishReason, TokenEvent};
use caracal_actors::scheduler::{SchedulerConfig, SchedulerState};
use common::{expected, greedy, CountingLm, VOCAB};
use tokio::sync::mpsc;

/// A grammar given as one set of allowed ids per position; done after the
/// last position (or never, with `endless`). It can be told to fail.
#[derive(Debug)]
struct Script {
    /// Allowed ids at each position.
    steps: Vec<Vec<u32>>,
    /// Position of the next token.
    pos: usize,
    /// Repeat the last step forever instead of completing.
    endless: bool,
    /// `compute_mask` fails at this position.
    fail_mask_at: Option<usize>,
    /// Every id consumed, forced ones included.
    consumed: Vec<u32>,
}

impl Script {
    fn new(steps: Vec<Vec<u32>>) -> Script {
        Script {
            steps,
            pos: 0,
            endless: false,
            fail_mask_at: None,
            consumed: Vec::new(),
        }
    }

    fn allowed(&self) -> &[u32] {
        let i = if self.endless {
            self.pos.min(self.steps.len() - 1)
        } else {
            self.pos
        };
        self.steps.get(i).map(Vec::as_slice).unwrap_or(&[])
    }
}

impl Constraint for Script {
    fn compute_mask(&mut self) -> Result<TokenMask, ConstraintError> {
        if self.fail_mask_at == Some(self.pos) {
            return Err(ConstraintError::Stuck("scripted failure".into()));
        }
        let mut m = TokenMask::none(VOCAB);
        for &t in self.allowed() {
            m.allow(t);
        }
        Ok(m)
    }

    fn consume(&mut self, token: u32) -> Result<(), ConstraintError> {
        if self.is_done() {
            return Err(ConstraintError::AfterDone(token));
        }
        if !self.allowed().contains(&token) {
            return Err(ConstraintError::TokenRejected {
                token,
                reason: format!("position {} allows {:?}", self.pos, self.allowed()),
            });
        }
        self.consumed.push(token);
        self.pos += 1;
        Ok(())
    }

    fn forced_tokens(&mut self) -> Result<Vec<u32>, ConstraintError> {
        if self.endless {
            return Ok(Vec::new());
        }
        Ok(self.steps[self.pos.min(self.steps.len())..]
            .iter()
            .take_while(|s| s.len() == 1)
            .map(|s| s[0])
            .collect())
    }

    fn is_done(&self) -> bool {
        !self.endless && self.pos >= self.steps.len()
    }
}

/// How a stream ended, and its ids.
#[derive(Debug, Clone, PartialEq)]
enum End {
    Finished(FinishReason, usize),
    Error(ErrorKind, String),
}

fn read_ready(rx: &mut mpsc::Receiver<TokenEvent>) -> (Vec<u32>, Option<End>) {
    let mut ids = Vec::new();
    while let Ok(ev) = rx.try_recv() {
        match ev {
            TokenEvent::Token { id, .. } => ids.push(id),
            TokenEvent::Finished {
                reason,
                completion_tokens,
                ..
            } => return (ids, Some(End::Finished(reason, completion_tokens))),
            TokenEvent::Error { kind, message } => return (ids, Some(End::Error(kind, message))),
        }
    }
    (ids, None)
}

fn scheduler() -> SchedulerState {
    SchedulerState::new(
        Arc::new(CountingLm::new(false)),
        64,
        SchedulerConfig {
            page_size: 4,
            ..Default::default()
        },
        None,
    )
}

fn run(s: &mut SchedulerState) {
    while s.has_work() {
        s.step();
    }
    s.memory().check_quiescent().unwrap();
}

fn constrained(c: Script, jump_forward: bool) -> Option<SeqConstraint> {
    Some(SeqConstraint {
        constraint: Box::new(c),
        jump_forward,
    })
}

#[test]
fn only_the_ids_the_mask_allows_are_sampled() {
    let allowed = vec![7u32, 13, 40];
    let mut c = Script::new(vec![allowed.clone()]);
    c.endless = true;
    let prompt = vec![1, 2, 3];
    // Unconstrained, the model would mostly pick other ids.
    let free = expected(&prompt, 20);
    assert!(free.iter().any(|t| !allowed.contains(t)));
    let mut s = scheduler();
    let (tx, mut rx) = mpsc::channel(64);
    s.enqueue_with(greedy(prompt, 20, None), tx, constrained(c, true))
        .unwrap();
    run(&mut s);
    let (ids, end) = read_ready(&mut rx);
    assert_eq!(end, Some(End::Finished(FinishReason::Length, 20)));
    assert_eq!(ids.len(), 20);
    assert!(ids.iter().all(|t| allowed.contains(t)), "{ids:?}");
}

#[test]
fn a_failing_grammar_ends_only_its_own_sequence() {
    let mut c = Script::new(vec![(0..VOCAB as u32).collect()]);
    c.endless = true;
    c.fail_mask_at = Some(3);
    let mut s = scheduler();
    let (tx_bad, mut rx_bad) = mpsc::channel(64);
    let (tx_ok, mut rx_ok) = mpsc::channel(64);
    s.enqueue_with(greedy(vec![5, 6], 10, None), tx_bad, constrained(c, true))
        .unwrap();
    s.enqueue(greedy(vec![8, 9, 10], 10, None), tx_ok).unwrap();
    run(&mut s);
    let (ids, end) = read_ready(&mut rx_bad);
    assert_eq!(ids.len(), 3, "three tokens before the failing mask");
    match end {
        Some(End::Error(ErrorKind::ConstraintViolation, m)) => {
            assert!(m.contains("scripted failure"), "{m}")
        }
        other => panic!("expected a constraint violation, got {other:?}"),
    }
    assert_eq!(
        ErrorKind::ConstraintViolation.as_str(),
        "constraint_violation"
    );
    let (ids, end) = read_ready(&mut rx_ok);
    assert_eq!(ids, expected(&[8, 9, 10], 10));
    assert_eq!(end, Some(End::Finished(FinishReason::Length, 10)));
    assert_eq!(s.stats().constraint_failures, 1);
    assert_eq!(
        s.memory_stats().free_pages + s.memory_stats().cached_pages,
        64
    );
}

#[test]
fn a_complete_grammar_finishes_with_stop() {
    let steps = vec![vec![3, 4], vec![9], vec![20, 21, 22], vec![1, 2]];
    let mut s = scheduler();
    let (tx, mut rx) = mpsc::channel(64);
    s.enqueue_with(
        greedy(vec![1, 2, 3], 50, None),
        tx,
        constrained(Script::new(steps.clone()), false),
    )
    .unwrap();
    run(&mut s);
    let (ids, end) = read_ready(&mut rx);
    assert_eq!(end, Some(End::Finished(FinishReason::Stop, 4)));
    assert_eq!(ids.len(), 4);
    for (t, allowed) in ids.iter().zip(&steps) {
        assert!(allowed.contains(t), "{t} not in {allowed:?}");
    }
}

/// A grammar with long forced runs (fixed keys) between free choices.
fn keyed_grammar() -> Vec<Vec<u32>> {
    let mut steps = Vec::new();
    for key in 0..4u32 {
        for k in 0..6 {
            steps.push(vec![10 + key * 6 + k]); // a fixed key, six tokens
        }
        steps.push(vec![40, 41, 42, 43, 44, 45]); // a free value
    }
    steps.push(vec![50]);
    steps
}

fn run_keyed(jump_forward: bool, prompt: &[u32]) -> (Vec<u32>, u64, u64) {
    let mut s = scheduler();
    let (tx, mut rx) = mpsc::channel(64);
    s.enqueue_with(
        greedy(prompt.to_vec(), 100, None),
        tx,
        constrained(Script::new(keyed_grammar()), jump_forward),
    )
    .unwrap();
    run(&mut s);
    let (ids, end) = read_ready(&mut rx);
    assert_eq!(
        end,
        Some(End::Finished(FinishReason::Stop, keyed_grammar().len()))
    );
    let st = s.stats();
    (ids, st.steps, st.forced_tokens)
}

#[test]
fn jump_forward_gives_the_same_ids_in_fewer_steps() {
    let prompt = [2u32, 7, 1, 8, 2, 8];
    let (plain, plain_steps, plain_forced) = run_keyed(false, &prompt);
    let (jumped, jumped_steps, jumped_forced) = run_keyed(true, &prompt);
    assert_eq!(plain, jumped);
    assert_eq!(plain.len(), keyed_grammar().len());
    for (t, allowed) in plain.iter().zip(keyed_grammar()) {
        assert!(allowed.contains(t));
    }
    assert_eq!(plain_forced, 0);
    assert!(jumped_forced > 0);
    // One step per token without it; with it, one per free choice plus the
    // first forced token of each run (sampled under its one-token mask).
    assert_eq!(plain_steps as usize, plain.len());
    assert!(
        jumped_steps < plain_steps / 2,
        "{jumped_steps} steps with jump-forward, {plain_steps} without"
    );
}

#[test]
fn constrained_and_free_sequences_share_batches() {
    let mut s = scheduler();
    let mut free = Vec::new();
    let mut guided = Vec::new();
    for i in 0..6u32 {
        let (tx, rx) = mpsc::channel(64);
        let prompt = vec![1 + i, 2 + i, 3];
        if i % 2 == 0 {
            s.enqueue(greedy(prompt.clone(), 12, None), tx).unwrap();
            free.push((prompt, rx));
        } else {
            let mut c = Script::new(vec![vec![30 + i, 31 + i]]);
            c.endless = true;
            s.enqueue_with(greedy(prompt, 12, None), tx, constrained(c, true))
                .unwrap();
            guided.push((i, rx));
        }
    }
    run(&mut s);
    for (prompt, mut rx) in free {
        let (ids, end) = read_ready(&mut rx);
        assert_eq!(ids, expected(&prompt, 12));
        assert_eq!(end, Some(End::Finished(FinishReason::Length, 12)));
    }
    for (i, mut rx) in guided {
        let (ids, end) = read_ready(&mut rx);
        assert_eq!(end, Some(End::Finished(FinishReason::Length, 12)));
        assert!(ids.iter().all(|&t| t == 30 + i || t == 31 + i), "{ids:?}");
    }
}
