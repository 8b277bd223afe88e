//! SessionMemory: which KV pages hold what, shared through a radix tree.
//!
//! Owns the page accounting ([`PageAllocator`]), the prefix cache
//! ([`RadixCache`]), the KDA state snapshots of hybrid models and the
//! session pins. The KV *data* lives in the scheduler's pool; page ids mean
//! the same thing on both sides.
//!
//! It is plain state owned by the scheduler ([`crate::scheduler::SchedulerState`])
//! on the scheduler's thread: admission ([`SessionMemory::admit`]), commit
//! ([`SessionMemory::commit`]), release ([`SessionMemory::release`]) and the
//! release of a superseded path ([`SessionMemory::drop_path`]) are
//! method calls that cannot be lost, so a page or lock is given back exactly
//! when the scheduler lets go of a sequence. Other threads see its counters
//! only through the [`MemoryStats`] the scheduler publishes after each step.
//!
//! Rules that keep output correct:
//! - a prefix hit for a hybrid model is valid only at a boundary whose KDA
//!   snapshot was actually written ([`RadixCache::match_prefix_with_snapshot`]);
//! - a match is limited to `prompt − 1` tokens, so at least one token is
//!   computed and yields logits;
//! - a cancelled sequence commits nothing it produced.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::engine::LinearState;
use crate::messages::{MemoryStats, MissReason};
use crate::pages::PageAllocator;
use crate::radix::{NodeId, RadixCache, SnapshotId};

/// Find the cached prefix of `key`, lock it, and reserve pages for
/// `reserve_tokens` tokens in total ([`SessionMemory::admit`]).
#[derive(Debug, Clone)]
pub struct MatchPrefix {
    /// Radix key of the prompt.
    pub key: Vec<u64>,
    /// The model has recurrent (KDA) layers: only snapshot boundaries hit.
    pub hybrid: bool,
    /// Tokens the sequence may grow to (prompt + max_tokens).
    pub reserve_tokens: usize,
}

/// The answer to [`MatchPrefix`]: pages and a lock the caller now holds
/// until it commits or releases the sequence.
#[derive(Debug, Clone)]
pub struct Admission {
    /// Prompt tokens served from cache (a multiple of the page size).
    pub cached_tokens: usize,
    /// The sequence's block table: cached pages, then fresh ones.
    pub pages: Vec<u32>,
    /// The locked radix node at the end of the cached prefix.
    pub node: NodeId,
    /// KDA state at `cached_tokens` (hybrid models with a hit).
    pub snapshot: Option<Arc<Vec<LinearState>>>,
    /// Why the rest of the prompt missed (`None` when all that can hit did).
    pub miss_reason: Option<MissReason>,
}

/// SessionMemory errors.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MemoryError {
    /// Not enough pages even after evicting every unlocked prefix.
    #[error("KV cache full: {needed} pages needed, {available} obtainable")]
    OutOfPages {
        /// Pages needed.
        needed: usize,
        /// Pages free or evictable.
        available: usize,
    },
    /// A stale or unknown radix node.
    #[error("radix cache: {0}")]
    Radix(String),
}

/// A sequence finished: cache its tokens and pin the session's path
/// ([`SessionMemory::commit`]).
#[derive(Debug)]
pub struct CommitSequence {
    /// Key of every token whose KV was written (prompt + generated, in order).
    pub key: Vec<u64>,
    /// The sequence's block table.
    pub pages: Vec<u32>,
    /// The node locked at admission.
    pub node: NodeId,
    /// Session to pin, if any.
    pub session: Option<String>,
    /// KDA states captured at page-aligned boundaries: `(tokens, states)`.
    pub snapshots: Vec<(usize, Vec<LinearState>)>,
}

/// A sequence was cancelled or failed: drop its references without caching
/// anything it produced ([`SessionMemory::release`]).
#[derive(Debug)]
pub struct ReleaseSequence {
    /// The sequence's block table.
    pub pages: Vec<u32>,
    /// The node locked at admission.
    pub node: NodeId,
}

/// Settings of the session memory.
#[derive(Debug, Clone)]
pub struct MemoryConfig {
    /// Pages in the pool (from `--kv-cache-memory`).
    pub num_pages: usize,
    /// Tokens per page (`--page-size`, default 16).
    pub page_size: usize,
    /// How long a session's pinned path survives without use (`--session-ttl`, default 600 s).
    pub session_ttl: Duration,
}

/// The plain state of session memory (owned by the scheduler).
pub struct SessionMemory {
    /// Page reference counts.
    pages: PageAllocator,
    /// Prefix cache over token keys.
    radix: RadixCache,
    /// KDA snapshots by id.
    snapshots: HashMap<SnapshotId, Arc<Vec<LinearState>>>,
    /// Next snapshot id.
    next_snapshot: SnapshotId,
    /// Session → (pinned node, last use).
    pins: HashMap<String, (NodeId, Instant)>,
    /// Settings.
    cfg: MemoryConfig,
    /// Prompt tokens looked up, over all admissions.
    lookup_tokens: u64,
    /// Prompt tokens served from cache.
    hit_tokens: u64,
}

impl SessionMemory {
    /// An empty memory of `cfg.num_pages` pages.
    pub fn new(cfg: MemoryConfig) -> SessionMemory {
        SessionMemory {
            pages: PageAllocator::new(cfg.num_pages as u32),
            radix: RadixCache::new(cfg.page_size.max(1)).expect("page size is positive"),
            snapshots: HashMap::new(),
            next_snapshot: 1,
            pins: HashMap::new(),
            cfg,
            lookup_tokens: 0,
            hit_tokens: 0,
        }
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.cfg.page_size.max(1)
    }

    /// Pages in the pool.
    pub fn num_pages(&self) -> usize {
        self.pages.num_pages()
    }

    /// The settings it was made with.
    pub fn config(&self) -> &MemoryConfig {
        &self.cfg
    }

    fn drop_snapshots(&mut self, ids: &[SnapshotId]) {
        for id in ids {
            self.snapshots.remove(id);
        }
    }

    /// Frees pages by evicting unlocked prefixes until `needed` are free.
    fn make_room(&mut self, needed: usize) {
        let free = self.pages.free_count();
        if needed > free {
            let ev = self.radix.evict(needed - free);
            self.pages.release(&ev.pages);
            self.drop_snapshots(&ev.snapshots);
        }
    }

    /// Unpins sessions idle for longer than the TTL.
    pub fn expire_pins(&mut self, now: Instant) {
        let ttl = self.cfg.session_ttl;
        let expired: Vec<String> = self
            .pins
            .iter()
            .filter(|(_, (_, t))| now.duration_since(*t) > ttl)
            .map(|(s, _)| s.clone())
            .collect();
        for s in expired {
            if let Some((node, _)) = self.pins.remove(&s) {
                let _ = self.radix.unlock(node);
            }
        }
    }

    /// Looks up `m.key`, locks the hit, and reserves the rest of the pages.
    pub fn admit(&mut self, m: &MatchPrefix) -> Result<Admission, MemoryError> {
        self.expire_pins(Instant::now());
        let p = self.cfg.page_size;
        let usable = &m.key[..m.key.len().saturating_sub(1)];
        let plain = self.radix.match_prefix(usable);
        let (tokens, pages, node, snapshot, snapshot_miss) = if m.hybrid {
            match self.radix.match_prefix_with_snapshot(usable) {
                Some(s) => {
                    let why = (s.tokens < plain.tokens).then_some(MissReason::SnapshotBehind {
                        cached: plain.tokens,
                        snapshot_at: s.tokens,
                    });
                    (
                        s.tokens,
                        s.pages,
                        s.node,
                        self.snapshots.get(&s.snapshot).cloned(),
                        why,
                    )
                }
                None => {
                    let why = (plain.tokens > 0).then_some(MissReason::NoSnapshot {
                        cached: plain.tokens,
                    });
                    (0, Vec::new(), self.radix.root(), None, why)
                }
            }
        } else {
            (plain.tokens, plain.pages, plain.node, None, None)
        };
        let miss_reason = if snapshot_miss.is_some() {
            snapshot_miss
        } else if tokens == m.key.len() {
            None
        } else if tokens == 0 && self.radix.total_tokens() == 0 {
            Some(MissReason::CacheEmpty)
        } else if tokens == 0 {
            Some(MissReason::NoCachedPrefix)
        } else if tokens + p > usable.len() {
            Some(MissReason::PartialPage {
                tail: m.key.len() - tokens,
                page_size: p,
            })
        } else {
            Some(MissReason::Diverged { after: tokens })
        };
        self.radix
            .lock(node)
            .map_err(|e| MemoryError::Radix(e.to_string()))?;
        self.pages.retain(&pages);
        let total = m.reserve_tokens.max(m.key.len()).div_ceil(p);
        let needed = total.saturating_sub(pages.len());
        self.make_room(needed);
        let fresh = match self.pages.alloc(needed) {
            Ok(f) => f,
            Err(_) => {
                let available = self.pages.free_count();
                self.pages.release(&pages);
                let _ = self.radix.unlock(node);
                return Err(MemoryError::OutOfPages { needed, available });
            }
        };
        self.lookup_tokens += m.key.len() as u64;
        self.hit_tokens += tokens as u64;
        let mut all = pages;
        all.extend(fresh);
        Ok(Admission {
            cached_tokens: tokens,
            pages: all,
            node,
            snapshot,
            miss_reason,
        })
    }

    /// Caches a finished sequence's whole pages and snapshots, pins its session.
    pub fn commit(&mut self, c: CommitSequence) {
        let p = self.cfg.page_size;
        let full = (c.key.len() / p).min(c.pages.len());
        match self.radix.insert(&c.key[..full * p], &c.pages[..full]) {
            Ok(res) => {
                self.pages.release(&res.duplicate_pages);
                self.pages.release(&c.pages[full..]);
                for (boundary, states) in c.snapshots {
                    if boundary == 0 || boundary > full * p || boundary % p != 0 {
                        continue;
                    }
                    let id = self.next_snapshot;
                    self.next_snapshot += 1;
                    self.snapshots.insert(id, Arc::new(states));
                    match self.radix.set_snapshot(&c.key[..boundary], id) {
                        Ok(Some(old)) => {
                            self.snapshots.remove(&old);
                        }
                        Ok(None) => {}
                        // The tree did not take it: nothing would ever free it.
                        Err(_) => {
                            self.snapshots.remove(&id);
                        }
                    }
                }
                if let Some(session) = c.session {
                    if self.radix.lock(res.node).is_ok() {
                        if let Some((old, _)) =
                            self.pins.insert(session, (res.node, Instant::now()))
                        {
                            let _ = self.radix.unlock(old);
                        }
                    }
                }
            }
            Err(e) => {
                tracing::error!("radix insert failed, dropping the sequence's pages: {e}");
                self.pages.release(&c.pages);
            }
        }
        let _ = self.radix.unlock(c.node);
    }

    /// Drops a cancelled sequence's references.
    pub fn release(&mut self, r: ReleaseSequence) {
        self.pages.release(&r.pages);
        let _ = self.radix.unlock(r.node);
    }

    /// Unpins a session now (its connection closed).
    pub fn unpin(&mut self, session: &str) {
        if let Some((node, _)) = self.pins.remove(session) {
            let _ = self.radix.unlock(node);
        }
    }

    /// Releases a path its session has superseded ([`crate::messages::DropPath`]):
    /// unpins `session` first when given, then removes every cached path that agrees
    /// with `path` through the page holding token `from` (the first superseded one) and
    /// that no running sequence holds. Returns the pages freed.
    pub fn drop_path(&mut self, session: Option<&str>, path: &[u64], from: usize) -> usize {
        if let Some(s) = session {
            self.unpin(s);
        }
        let end = (from / self.page_size() + 1) * self.page_size();
        if end > path.len() {
            return 0; // the page holding `from` was never cached whole
        }
        let ev = self.radix.evict_prefix(&path[..end]);
        let before = self.pages.free_count();
        self.pages.release(&ev.pages);
        self.drop_snapshots(&ev.snapshots);
        self.pages.free_count() - before
    }

    /// Occupancy counters.
    pub fn stats(&self) -> MemoryStats {
        MemoryStats {
            total_pages: self.pages.num_pages(),
            free_pages: self.pages.free_count(),
            cached_pages: self.radix.cached_pages(),
            evictable_pages: self.radix.evictable_pages(),
            pinned_sessions: self.pins.len(),
            snapshots: self.snapshots.len(),
            lookup_tokens: self.lookup_tokens,
            hit_tokens: self.hit_tokens,
        }
    }

    /// Checks that every page is free or owned by the tree exactly once and
    /// that no lock is held besides session pins (test support).
    pub fn check_quiescent(&self) -> Result<(), String> {
        self.radix.check_invariants().map_err(|e| e.to_string())?;
        let owned = self.radix.owned_pages();
        if owned.len() + self.pages.free_count() != self.pages.num_pages() {
            return Err(format!(
                "leak: {} tree pages + {} free != {} total",
                owned.len(),
                self.pages.free_count(),
                self.pages.num_pages()
            ));
        }
        if let Some(p) = owned.iter().find(|&&p| self.pages.refcount(p) != 1) {
            return Err(format!(
                "tree page {p} has refcount {}",
                self.pages.refcount(*p)
            ));
        }
        if self.pins.is_empty() && self.radix.evictable_pages() != self.radix.cached_pages() {
            return Err(format!(
                "locks left: {} of {} cached pages are not evictable",
                self.radix.cached_pages() - self.radix.evictable_pages(),
                self.radix.cached_pages()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mem(pages: usize) -> SessionMemory {
        SessionMemory::new(MemoryConfig {
            num_pages: pages,
            page_size: 4,
            session_ttl: Duration::from_secs(60),
        })
    }

    fn key(n: usize) -> Vec<u64> {
        (0..n as u64).collect()
    }

    #[test]
    fn second_request_hits_the_committed_prefix() {
        let mut m = mem(16);
        let a = m
            .admit(&MatchPrefix {
                key: key(10),
                hybrid: false,
                reserve_tokens: 14,
            })
            .unwrap();
        assert_eq!(a.cached_tokens, 0);
        assert_eq!(a.miss_reason.unwrap().to_string(), "cache empty");
        m.commit(CommitSequence {
            key: key(13),
            pages: a.pages,
            node: a.node,
            session: None,
            snapshots: vec![],
        });
        let b = m
            .admit(&MatchPrefix {
                key: key(20),
                hybrid: false,
                reserve_tokens: 20,
            })
            .unwrap();
        assert_eq!(b.cached_tokens, 12);
        m.release(ReleaseSequence {
            pages: b.pages,
            node: b.node,
        });
        m.check_quiescent().unwrap();
    }

    #[test]
    fn hybrid_hit_needs_a_written_snapshot() {
        let mut m = mem(16);
        let a = m
            .admit(&MatchPrefix {
                key: key(10),
                hybrid: true,
                reserve_tokens: 12,
            })
            .unwrap();
        let st = vec![LinearState {
            conv: vec![1.0],
            recurrent: vec![2.0],
        }];
        m.commit(CommitSequence {
            key: key(12),
            pages: a.pages,
            node: a.node,
            session: None,
            snapshots: vec![(4, st.clone())],
        });
        let b = m
            .admit(&MatchPrefix {
                key: key(20),
                hybrid: true,
                reserve_tokens: 20,
            })
            .unwrap();
        assert_eq!(
            b.cached_tokens, 4,
            "only the boundary with a snapshot may hit"
        );
        assert_eq!(b.snapshot.as_deref(), Some(&st));
        let why = b.miss_reason.map(|r| r.to_string()).unwrap_or_default();
        assert!(why.contains("snapshot"), "{}", why);
        m.release(ReleaseSequence {
            pages: b.pages,
            node: b.node,
        });
        m.check_quiescent().unwrap();
    }

    #[test]
    fn cancelled_sequence_caches_nothing() {
        let mut m = mem(8);
        let a = m
            .admit(&MatchPrefix {
                key: key(8),
                hybrid: false,
                reserve_tokens: 8,
            })
            .unwrap();
        m.release(ReleaseSequence {
            pages: a.pages,
            node: a.node,
        });
        assert_eq!(m.stats().cached_pages, 0);
        assert_eq!(m.stats().free_pages, 8);
    }

    #[test]
    fn full_pool_evicts_unpinned_prefixes_then_refuses() {
        let mut m = mem(4);
        let a = m
            .admit(&MatchPrefix {
                key: key(8),
                hybrid: false,
                reserve_tokens: 8,
            })
            .unwrap();
        m.commit(CommitSequence {
            key: key(8),
            pages: a.pages,
            node: a.node,
            session: None,
            snapshots: vec![],
        });
        let other: Vec<u64> = (100..116).collect();
        let b = m
            .admit(&MatchPrefix {
                key: other.clone(),
                hybrid: false,
                reserve_tokens: 16,
            })
            .unwrap();
        assert_eq!(
            b.pages.len(),
            4,
            "the cached prefix was evicted to make room"
        );
        let err = m
            .admit(&MatchPrefix {
                key: key(4),
                hybrid: false,
                reserve_tokens: 4,
            })
            .unwrap_err();
        assert!(matches!(err, MemoryError::OutOfPages { .. }));
        m.release(ReleaseSequence {
            pages: b.pages,
            node: b.node,
        });
        m.check_quiescent().unwrap();
    }

    #[test]
    fn dropped_path_frees_its_pages_but_not_the_new_one() {
        let mut m = mem(16);
        let commit = |m: &mut SessionMemory, key: Vec<u64>| {
            let a = m
                .admit(&MatchPrefix {
                    key: key.clone(),
                    hybrid: false,
                    reserve_tokens: key.len(),
                })
                .unwrap();
            m.commit(CommitSequence {
                key,
                pages: a.pages,
                node: a.node,
                session: Some("s".into()),
                snapshots: vec![],
            });
        };
        // A session's path [0..4) [4..12), then a new one sharing only the first page.
        commit(&mut m, key(12));
        let new: Vec<u64> = (0..4).chain(100..108).collect();
        commit(&mut m, new.clone());
        assert_eq!(
            m.stats().cached_pages,
            5,
            "old path unpinned but still cached"
        );
        // Superseded from token 5 on: the page holding it (4..8) and what follows.
        let freed = m.drop_path(None, &key(12), 5);
        assert_eq!(freed, 2, "the old path's two pages after the shared one");
        assert_eq!(m.stats().cached_pages, 3);
        assert_eq!(m.stats().pinned_sessions, 1, "the new path stays pinned");
        assert_eq!(
            m.drop_path(None, &key(6), 5),
            0,
            "page 4..8 not whole in the path"
        );
        // Dropping the pinned path needs the session unpinned first.
        assert_eq!(m.drop_path(None, &new, 4), 0, "pinned: nothing freed");
        assert_eq!(m.drop_path(Some("s"), &new, 4), 2);
        assert_eq!(m.stats().pinned_sessions, 0);
        m.check_quiescent().unwrap();
    }

    #[test]
    fn pinned_session_survives_pressure_until_unpinned() {
        let mut m = mem(4);
        let a = m
            .admit(&MatchPrefix {
                key: key(8),
                hybrid: false,
                reserve_tokens: 8,
            })
            .unwrap();
        m.commit(CommitSequence {
            key: key(8),
            pages: a.pages,
            node: a.node,
            session: Some("s1".into()),
            snapshots: vec![],
        });
        let other: Vec<u64> = (100..116).collect();
        assert!(m
            .admit(&MatchPrefix {
                key: other.clone(),
                hybrid: false,
                reserve_tokens: 16
            })
            .is_err());
        m.unpin("s1");
        let b = m
            .admit(&MatchPrefix {
                key: other,
                hybrid: false,
                reserve_tokens: 16,
            })
            .unwrap();
        m.release(ReleaseSequence {
            pages: b.pages,
            node: b.node,
        });
        m.check_quiescent().unwrap();
    }
}
