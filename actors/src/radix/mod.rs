//! Radix tree mapping token prefixes to cached KV pages (session memory).
//!
//! Modelled on SGLang's `RadixCache` with `page_size > 1` (RadixAttention): a compressed
//! trie whose edges are token segments, page granular. It is plain state owned by
//! SessionMemory (inside the scheduler): single-threaded, no locks, no channels.
//!
//! # Keys
//! Key elements are `u64`. Text token ids are widened to `u64`; a media span (image,
//! audio or video patch tokens) is keyed by values the caller derives from the content
//! hash of the media (for example one hash-derived value per placeholder position), so
//! that the same picture at the same place hits the cache and a different picture with
//! the same placeholder ids does not. The tree only compares values.
//!
//! # Pages
//! Each node stores a key segment whose length is a multiple of `page_size`, and one page
//! id per `page_size` tokens of that segment. Only whole pages are stored: inserting a key
//! of `L` tokens stores `L / page_size` pages, and a match returns whole pages only. The
//! tree holds one reference to every page it stores (see [`crate::pages`]); it hands the
//! page ids back from [`RadixCache::evict`] and the caller releases them.
//!
//! # Recurrent-state snapshots (hybrid KDA models)
//! A KDA layer's recurrent state cannot be cut at an arbitrary token, so a prefix hit for
//! a hybrid model is valid only where a state snapshot was actually written. A node may
//! carry a [`SnapshotId`] meaning "a snapshot exists for the prefix ending exactly at the
//! end of this node"; [`RadixCache::set_snapshot`] splits a node so that the boundary is a
//! node end, and [`RadixCache::match_prefix_with_snapshot`] returns the longest cached
//! prefix that ends at such a boundary. A snapshot dies with the node that carries it.
//!
//! Property tests (a simulated session memory and a brute-force prefix model)
//! live in `actors/tests/radix_props.rs`.
//!
//! # Locks and eviction
//! A running request locks the node at the end of its matched prefix
//! ([`RadixCache::lock`]); the lock counts on that node and every ancestor, and locked
//! nodes are never evicted. [`RadixCache::evict`] removes least-recently-used unlocked
//! leaves (by a monotonic access tick, not wall time), repeatedly, since a parent becomes
//! a leaf when its last child goes. Because a lock covers all ancestors, every unlocked
//! node's whole subtree is unlocked, so [`RadixCache::evictable_pages`] pages can always
//! be evicted.
//!
//! # Node ids
//! [`NodeId`] carries a generation, so a handle to a node that was evicted (and whose
//! slot was reused) is rejected with [`RadixError::StaleNode`] instead of touching an
//! unrelated node. Splitting keeps the original node as the lower part: a [`NodeId`] held
//! by a caller keeps naming the same prefix end.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};

use thiserror::Error;

/// Caller-chosen id of a recurrent-state (KDA) snapshot stored outside the tree.
pub type SnapshotId = u64;

/// Slot index of the root node, which always exists and never holds pages.
const ROOT: u32 = 0;

/// Errors of [`RadixCache`].
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RadixError {
    /// `page_size` was 0.
    #[error("page_size must be at least 1, got 0")]
    ZeroPageSize,
    /// A boundary was not a multiple of the page size.
    #[error("boundary of {tokens} tokens is not a multiple of page_size {page_size}")]
    NotPageAligned {
        /// Length of the key given.
        tokens: usize,
        /// The tree's page size.
        page_size: usize,
    },
    /// A snapshot was set at token 0 (the empty prefix needs no snapshot).
    #[error("a snapshot boundary must be after at least one page, got 0 tokens")]
    EmptyBoundary,
    /// A snapshot boundary lies beyond what the tree caches for that key.
    #[error("boundary at {tokens} tokens is not cached (only {cached} tokens of that key are)")]
    NotCached {
        /// Boundary asked for.
        tokens: usize,
        /// Length of the cached prefix of the key.
        cached: usize,
    },
    /// `insert` got a page count that does not match the key's whole pages.
    #[error("key of {tokens} tokens with page_size {page_size} needs {expected} pages, got {got}")]
    PageCountMismatch {
        /// Length of the key given.
        tokens: usize,
        /// The tree's page size.
        page_size: usize,
        /// `tokens / page_size`.
        expected: usize,
        /// Pages given.
        got: usize,
    },
    /// A [`NodeId`] names a node that no longer exists (it was evicted).
    #[error("node {0:?} no longer exists")]
    StaleNode(NodeId),
    /// `unlock` on a node whose lock count is already 0.
    #[error("node {0:?} is not locked")]
    NotLocked(NodeId),
    /// `check_invariants` found the tree inconsistent (a bug in this module).
    #[error("radix tree invariant broken: {0}")]
    InvariantBroken(String),
}

/// Handle to a node of a [`RadixCache`]; stays valid until that node is evicted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NodeId {
    /// Slot index in the node arena.
    index: u32,
    /// Generation of the slot when the handle was made; a reused slot has a newer one.
    generation: u32,
}

/// Result of [`RadixCache::match_prefix`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Tokens of the key covered by cached pages (a multiple of the page size).
    pub tokens: usize,
    /// Pages backing those tokens, in order (`tokens / page_size` of them).
    pub pages: Vec<u32>,
    /// Node ending exactly at `tokens` (the root when nothing matched); lock it while
    /// the pages are in use.
    pub node: NodeId,
}

/// Result of [`RadixCache::match_prefix_with_snapshot`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotMatch {
    /// Tokens of the key covered, ending at a boundary with a written snapshot.
    pub tokens: usize,
    /// Pages backing those tokens, in order.
    pub pages: Vec<u32>,
    /// Node ending exactly at `tokens`; lock it while the pages and state are in use.
    pub node: NodeId,
    /// Snapshot of the recurrent state after exactly `tokens` tokens.
    pub snapshot: SnapshotId,
}

/// Result of [`RadixCache::insert`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InsertResult {
    /// Node ending exactly at the inserted whole-page prefix (the root for an empty one).
    pub node: NodeId,
    /// The caller's pages for positions the tree already cached; the tree did not take
    /// them, so the caller releases them. They may be the tree's own page ids (when the
    /// caller got them from a match and retained them): releasing drops the caller's
    /// reference either way.
    pub duplicate_pages: Vec<u32>,
    /// How many of the caller's pages the tree took ownership of.
    pub new_pages: usize,
}

/// What [`RadixCache::evict`] removed; the caller releases the pages and drops the
/// snapshots.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Evicted {
    /// Pages the tree no longer holds.
    pub pages: Vec<u32>,
    /// Snapshots whose boundary was removed.
    pub snapshots: Vec<SnapshotId>,
}

/// One node of the tree: a key segment and the pages backing it.
#[derive(Debug, Clone)]
struct Node {
    /// Key segment from the parent's end to this node's end; a multiple of the page size,
    /// non-empty except at the root.
    key: Vec<u64>,
    /// One page per `page_size` tokens of `key`.
    pages: Vec<u32>,
    /// Parent slot; `None` only for the root.
    parent: Option<u32>,
    /// Children keyed by the key elements of their first page (distinct by construction).
    children: HashMap<Box<[u64]>, u32>,
    /// Number of locks on this node or any descendant; > 0 means not evictable.
    lock_ref: u32,
    /// Tick of the last match or insert that passed through this node (LRU order).
    last_access: u64,
    /// Snapshot of the recurrent state at the end of this node, if one was written.
    snapshot: Option<SnapshotId>,
}

impl Node {
    fn new(key: Vec<u64>, pages: Vec<u32>, parent: Option<u32>, tick: u64) -> Self {
        Self {
            key,
            pages,
            parent,
            children: HashMap::new(),
            lock_ref: 0,
            last_access: tick,
            snapshot: None,
        }
    }
}

/// Arena slot; a freed slot keeps its generation bumped so old handles fail.
#[derive(Debug, Clone)]
struct Slot {
    /// Incremented each time the slot's node is removed.
    generation: u32,
    /// The node, or `None` while the slot is free.
    node: Option<Node>,
}

/// Page-granular radix tree over token keys; see the module docs.
#[derive(Debug, Clone)]
pub struct RadixCache {
    /// Tokens per page (≥ 1).
    page_size: usize,
    /// Node arena; slot 0 is the root.
    slots: Vec<Slot>,
    /// Free slot indices for reuse.
    free_slots: Vec<u32>,
    /// Monotonic access counter, bumped by each match and insert.
    tick: u64,
    /// Pages stored in the tree.
    cached_pages: usize,
    /// Pages stored in nodes with `lock_ref == 0`.
    evictable_pages: usize,
    /// Live nodes other than the root.
    node_count: usize,
}

impl RadixCache {
    /// An empty tree with `page_size` tokens per page (fails on 0).
    pub fn new(page_size: usize) -> Result<Self, RadixError> {
        if page_size == 0 {
            return Err(RadixError::ZeroPageSize);
        }
        Ok(Self {
            page_size,
            slots: vec![Slot {
                generation: 0,
                node: Some(Node::new(Vec::new(), Vec::new(), None, 0)),
            }],
            free_slots: Vec::new(),
            tick: 0,
            cached_pages: 0,
            evictable_pages: 0,
            node_count: 0,
        })
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Handle of the root (the empty prefix).
    pub fn root(&self) -> NodeId {
        self.id(ROOT)
    }

    /// Longest cached prefix of `key` in whole pages; marks the path as just used.
    ///
    /// Splits a node when the match ends inside it, so that `node` ends exactly at
    /// `tokens`.
    pub fn match_prefix(&mut self, key: &[u64]) -> PrefixMatch {
        let key = self.whole_pages(key);
        let tick = self.bump_tick();
        self.get_mut(ROOT).last_access = tick;
        let (mut cur, mut pos, mut pages) = (ROOT, 0, Vec::new());
        while pos < key.len() {
            let Some(child) = self.child(cur, &key[pos..]) else {
                break;
            };
            let common = self.common_len(&self.get(child).key, &key[pos..]);
            let partial = common < self.get(child).key.len();
            let end = if partial {
                self.split(child, common)
            } else {
                child
            };
            let node = self.get_mut(end);
            node.last_access = tick;
            pages.extend_from_slice(&node.pages);
            pos += common;
            cur = end;
            if partial {
                break;
            }
        }
        PrefixMatch {
            tokens: pos,
            pages,
            node: self.id(cur),
        }
    }

    /// Longest cached prefix of `key` that ends at a boundary with a written snapshot;
    /// `None` when no such boundary is cached. Marks the path to it as just used.
    ///
    /// A longer cached prefix without a snapshot is ignored: for a hybrid model the KDA
    /// state there was never written, and resuming from it would corrupt the output.
    pub fn match_prefix_with_snapshot(&mut self, key: &[u64]) -> Option<SnapshotMatch> {
        let key = self.whole_pages(key);
        let (mut cur, mut pos) = (ROOT, 0);
        let mut path = Vec::new();
        // (index into path, tokens, snapshot) of the deepest boundary with a snapshot.
        let mut best = None;
        while pos < key.len() {
            let Some(child) = self.child(cur, &key[pos..]) else {
                break;
            };
            let node = self.get(child);
            if self.common_len(&node.key, &key[pos..]) < node.key.len() {
                break;
            }
            pos += node.key.len();
            path.push(child);
            if let Some(snapshot) = node.snapshot {
                best = Some((path.len(), pos, snapshot));
            }
            cur = child;
        }
        let (depth, tokens, snapshot) = best?;
        let tick = self.bump_tick();
        self.get_mut(ROOT).last_access = tick;
        let mut pages = Vec::with_capacity(tokens / self.page_size);
        for &i in &path[..depth] {
            let node = self.get_mut(i);
            node.last_access = tick;
            pages.extend_from_slice(&node.pages);
        }
        Some(SnapshotMatch {
            tokens,
            pages,
            node: self.id(path[depth - 1]),
            snapshot,
        })
    }

    /// Inserts the whole-page prefix of `key` backed by `pages` (one per whole page,
    /// `key.len() / page_size` of them; a trailing partial page is not stored).
    ///
    /// The tree takes ownership of the pages for positions it did not cache; the others
    /// are returned in [`InsertResult::duplicate_pages`] for the caller to release.
    pub fn insert(&mut self, key: &[u64], pages: &[u32]) -> Result<InsertResult, RadixError> {
        let ps = self.page_size;
        let expected = key.len() / ps;
        if pages.len() != expected {
            return Err(RadixError::PageCountMismatch {
                tokens: key.len(),
                page_size: ps,
                expected,
                got: pages.len(),
            });
        }
        let key = &key[..expected * ps];
        let tick = self.bump_tick();
        self.get_mut(ROOT).last_access = tick;
        let (mut cur, mut pos) = (ROOT, 0);
        let mut duplicate_pages = Vec::new();
        let mut new_pages = 0;
        while pos < key.len() {
            match self.child(cur, &key[pos..]) {
                None => {
                    let leaf_pages = pages[pos / ps..].to_vec();
                    new_pages = leaf_pages.len();
                    let leaf = self.alloc_node(Node::new(
                        key[pos..].to_vec(),
                        leaf_pages,
                        Some(cur),
                        tick,
                    ));
                    self.get_mut(cur)
                        .children
                        .insert(key[pos..pos + ps].into(), leaf);
                    self.cached_pages += new_pages;
                    self.evictable_pages += new_pages;
                    cur = leaf;
                    pos = key.len();
                }
                Some(child) => {
                    let common = self.common_len(&self.get(child).key, &key[pos..]);
                    duplicate_pages.extend_from_slice(&pages[pos / ps..(pos + common) / ps]);
                    let end = if common < self.get(child).key.len() {
                        self.split(child, common)
                    } else {
                        child
                    };
                    self.get_mut(end).last_access = tick;
                    pos += common;
                    cur = end;
                }
            }
        }
        Ok(InsertResult {
            node: self.id(cur),
            duplicate_pages,
            new_pages,
        })
    }

    /// Records that a recurrent-state snapshot exists for the prefix `key` (its whole
    /// length, a non-zero multiple of the page size, all cached), splitting a node so the
    /// boundary is a node end. Returns the snapshot it replaced, for the caller to drop.
    ///
    /// Does not change LRU order. Fails without changing the tree when the boundary is
    /// not page aligned, empty, or not cached.
    pub fn set_snapshot(
        &mut self,
        key: &[u64],
        id: SnapshotId,
    ) -> Result<Option<SnapshotId>, RadixError> {
        if !key.len().is_multiple_of(self.page_size) {
            return Err(RadixError::NotPageAligned {
                tokens: key.len(),
                page_size: self.page_size,
            });
        }
        if key.is_empty() {
            return Err(RadixError::EmptyBoundary);
        }
        let (mut cur, mut pos) = (ROOT, 0);
        while pos < key.len() {
            let child = self.child(cur, &key[pos..]).ok_or(RadixError::NotCached {
                tokens: key.len(),
                cached: pos,
            })?;
            let common = self.common_len(&self.get(child).key, &key[pos..]);
            if common < self.get(child).key.len() {
                if pos + common != key.len() {
                    return Err(RadixError::NotCached {
                        tokens: key.len(),
                        cached: pos + common,
                    });
                }
                cur = self.split(child, common);
            } else {
                cur = child;
            }
            pos += common;
        }
        Ok(self.get_mut(cur).snapshot.replace(id))
    }

    /// Adds a lock on `node` and each of its ancestors; locked nodes are never evicted.
    pub fn lock(&mut self, node: NodeId) -> Result<(), RadixError> {
        let mut cur = Some(self.resolve(node)?);
        while let Some(i) = cur {
            let n = self.get_mut(i);
            n.lock_ref += 1;
            let (first, len, parent) = (n.lock_ref == 1, n.pages.len(), n.parent);
            if first {
                self.evictable_pages -= len;
            }
            cur = parent;
        }
        Ok(())
    }

    /// Removes one lock taken by [`RadixCache::lock`] on `node`.
    pub fn unlock(&mut self, node: NodeId) -> Result<(), RadixError> {
        let start = self.resolve(node)?;
        if self.get(start).lock_ref == 0 {
            return Err(RadixError::NotLocked(node));
        }
        let mut cur = Some(start);
        while let Some(i) = cur {
            let n = self.get_mut(i);
            debug_assert!(n.lock_ref > 0, "ancestor of a locked node has lock_ref 0");
            n.lock_ref = n.lock_ref.saturating_sub(1);
            let (last, len, parent) = (n.lock_ref == 0, n.pages.len(), n.parent);
            if last {
                self.evictable_pages += len;
            }
            cur = parent;
        }
        Ok(())
    }

    /// Removes least-recently-used unlocked leaves, repeatedly, until at least
    /// `pages_wanted` pages are removed or nothing evictable remains.
    ///
    /// Ties in access time go to the lower slot index. Cost: one scan of the nodes plus
    /// a heap operation per evicted node.
    pub fn evict(&mut self, pages_wanted: usize) -> Evicted {
        let mut out = Evicted::default();
        if pages_wanted == 0 {
            return out;
        }
        let mut heap: BinaryHeap<Reverse<(u64, u32)>> = self
            .slots
            .iter()
            .enumerate()
            .skip(1)
            .filter_map(|(i, s)| s.node.as_ref().map(|n| (i, n)))
            .filter(|(_, n)| n.children.is_empty() && n.lock_ref == 0)
            .map(|(i, n)| Reverse((n.last_access, i as u32)))
            .collect();
        while out.pages.len() < pages_wanted {
            let Some(Reverse((_, i))) = heap.pop() else {
                break;
            };
            let node = self.free_node(i);
            let parent = node.parent.expect("only non-root nodes are evicted");
            let ps = self.page_size;
            let p = self.get_mut(parent);
            p.children.remove(&node.key[..ps]);
            if parent != ROOT && p.children.is_empty() && p.lock_ref == 0 {
                heap.push(Reverse((p.last_access, parent)));
            }
            self.cached_pages -= node.pages.len();
            self.evictable_pages -= node.pages.len();
            out.pages.extend(node.pages);
            out.snapshots.extend(node.snapshot);
        }
        out
    }

    /// Removes every unlocked node whose path extends `prefix` (its whole pages; a node
    /// the prefix ends inside extends it too), so a path its owner has superseded is
    /// released at once instead of waiting for LRU pressure. Locked nodes stay, and with
    /// them their ancestors; an unlocked node goes with its whole subtree (a lock covers
    /// every ancestor, so that subtree is unlocked). An empty prefix removes nothing.
    pub fn evict_prefix(&mut self, prefix: &[u64]) -> Evicted {
        let prefix = self.whole_pages(prefix);
        let mut out = Evicted::default();
        if prefix.is_empty() {
            return out;
        }
        let (mut cur, mut pos) = (ROOT, 0);
        let top = loop {
            let Some(child) = self.child(cur, &prefix[pos..]) else {
                return out;
            };
            let common = self.common_len(&self.get(child).key, &prefix[pos..]);
            if pos + common == prefix.len() {
                break child;
            }
            if common < self.get(child).key.len() {
                return out;
            }
            pos += common;
            cur = child;
        };
        let mut stack = vec![top];
        let mut doomed = Vec::new();
        while let Some(i) = stack.pop() {
            let n = self.get(i);
            if n.lock_ref == 0 {
                doomed.push(i);
            } else {
                stack.extend(n.children.values().copied());
            }
        }
        let ps = self.page_size;
        for root in doomed {
            let parent = self
                .get(root)
                .parent
                .expect("only non-root nodes are removed");
            let first: Box<[u64]> = self.get(root).key[..ps].into();
            self.get_mut(parent).children.remove(&first);
            let mut stack = vec![root];
            while let Some(i) = stack.pop() {
                let node = self.free_node(i);
                stack.extend(node.children.values().copied());
                self.cached_pages -= node.pages.len();
                self.evictable_pages -= node.pages.len();
                out.pages.extend(node.pages);
                out.snapshots.extend(node.snapshot);
            }
        }
        out
    }

    /// Pages stored in the tree.
    pub fn cached_pages(&self) -> usize {
        self.cached_pages
    }

    /// Pages that [`RadixCache::evict`] could remove now (those in unlocked nodes).
    pub fn evictable_pages(&self) -> usize {
        self.evictable_pages
    }

    /// Tokens stored in the tree (`cached_pages · page_size`).
    pub fn total_tokens(&self) -> usize {
        self.cached_pages * self.page_size
    }

    /// Number of nodes, not counting the root.
    pub fn node_count(&self) -> usize {
        self.node_count
    }

    /// Number of locks on `node` and its descendants.
    pub fn lock_ref(&self, node: NodeId) -> Result<u32, RadixError> {
        Ok(self.get(self.resolve(node)?).lock_ref)
    }

    /// Every page the tree holds, in no particular order.
    pub fn owned_pages(&self) -> Vec<u32> {
        self.nodes().flat_map(|n| n.pages.iter().copied()).collect()
    }

    /// Every snapshot the tree holds, in no particular order.
    pub fn snapshot_ids(&self) -> Vec<SnapshotId> {
        self.nodes().filter_map(|n| n.snapshot).collect()
    }

    /// Checks the tree's structural invariants; used by tests.
    ///
    /// Every non-root node has a non-empty key that is a multiple of the page size and
    /// `pages.len() · page_size` long; parent and child links agree; children are keyed
    /// by their first page; a node's lock count is at least the sum of its children's;
    /// no page appears twice; every node is reachable from the root; the page counters
    /// match the nodes.
    pub fn check_invariants(&self) -> Result<(), RadixError> {
        let fail = |msg: String| Err(RadixError::InvariantBroken(msg));
        let ps = self.page_size;
        let root = self.get(ROOT);
        if !root.key.is_empty() || !root.pages.is_empty() || root.parent.is_some() {
            return fail("root has a key, pages or a parent".into());
        }
        if root.snapshot.is_some() {
            return fail("root has a snapshot".into());
        }
        let mut seen_pages = HashSet::new();
        let (mut reached, mut cached, mut evictable) = (0, 0, 0);
        let mut stack = vec![ROOT];
        while let Some(i) = stack.pop() {
            let n = self.get(i);
            if i != ROOT {
                reached += 1;
                if n.key.is_empty() || !n.key.len().is_multiple_of(ps) {
                    return fail(format!(
                        "node {i} key length {} not whole pages",
                        n.key.len()
                    ));
                }
                if n.pages.len() * ps != n.key.len() {
                    return fail(format!(
                        "node {i} has {} pages for {} tokens",
                        n.pages.len(),
                        n.key.len()
                    ));
                }
                cached += n.pages.len();
                if n.lock_ref == 0 {
                    evictable += n.pages.len();
                }
            }
            for &p in &n.pages {
                if !seen_pages.insert(p) {
                    return fail(format!("page {p} appears twice"));
                }
            }
            let mut child_locks = 0u64;
            for (first, &c) in &n.children {
                let child = self.slots.get(c as usize).and_then(|s| s.node.as_ref());
                let Some(child) = child else {
                    return fail(format!("node {i} links to a free slot {c}"));
                };
                if child.parent != Some(i) {
                    return fail(format!("node {c} does not name {i} as its parent"));
                }
                if child.key.len() < ps || **first != child.key[..ps] {
                    return fail(format!("node {c} is not keyed by its first page"));
                }
                child_locks += u64::from(child.lock_ref);
                stack.push(c);
            }
            if u64::from(n.lock_ref) < child_locks {
                return fail(format!(
                    "node {i} lock_ref {} < children's {child_locks}",
                    n.lock_ref
                ));
            }
        }
        let live = self
            .slots
            .iter()
            .skip(1)
            .filter(|s| s.node.is_some())
            .count();
        if reached != live || live != self.node_count {
            return fail(format!(
                "{reached} nodes reachable, {live} live, count {}",
                self.node_count
            ));
        }
        if cached != self.cached_pages || evictable != self.evictable_pages {
            return fail(format!(
                "pages counted {cached}/{evictable}, recorded {}/{}",
                self.cached_pages, self.evictable_pages
            ));
        }
        Ok(())
    }

    // ---- internals ----

    /// `key` cut to whole pages.
    fn whole_pages<'k>(&self, key: &'k [u64]) -> &'k [u64] {
        &key[..key.len() / self.page_size * self.page_size]
    }

    fn bump_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    /// Child of `node` whose first page equals the first page of `rest` (which must
    /// hold at least one page).
    fn child(&self, node: u32, rest: &[u64]) -> Option<u32> {
        self.get(node)
            .children
            .get(&rest[..self.page_size])
            .copied()
    }

    /// Length in tokens of the common prefix of `a` and `b`, in whole pages.
    fn common_len(&self, a: &[u64], b: &[u64]) -> usize {
        a.chunks_exact(self.page_size)
            .zip(b.chunks_exact(self.page_size))
            .take_while(|(x, y)| x == y)
            .count()
            * self.page_size
    }

    /// Splits `child` at `at` tokens (a page multiple strictly inside its key). A new
    /// node takes the head and becomes `child`'s parent; `child` keeps the tail, its
    /// children and its snapshot, so handles to it still name the same prefix end.
    /// Returns the new head node.
    fn split(&mut self, child: u32, at: usize) -> u32 {
        let ps = self.page_size;
        let c = self.get_mut(child);
        let tail_key = c.key.split_off(at);
        let head_key = std::mem::replace(&mut c.key, tail_key);
        let tail_pages = c.pages.split_off(at / ps);
        let head_pages = std::mem::replace(&mut c.pages, tail_pages);
        let parent = c.parent.expect("split never targets the root");
        let (lock_ref, last_access) = (c.lock_ref, c.last_access);
        let tail_first: Box<[u64]> = c.key[..ps].into();
        let head_first: Box<[u64]> = head_key[..ps].into();
        let mut head = Node::new(head_key, head_pages, Some(parent), last_access);
        head.lock_ref = lock_ref;
        head.children.insert(tail_first, child);
        let head = self.alloc_node(head);
        self.get_mut(child).parent = Some(head);
        self.get_mut(parent).children.insert(head_first, head);
        head
    }

    fn alloc_node(&mut self, node: Node) -> u32 {
        self.node_count += 1;
        match self.free_slots.pop() {
            Some(i) => {
                self.slots[i as usize].node = Some(node);
                i
            }
            None => {
                self.slots.push(Slot {
                    generation: 0,
                    node: Some(node),
                });
                u32::try_from(self.slots.len() - 1).expect("fewer than 2^32 radix nodes")
            }
        }
    }

    fn free_node(&mut self, i: u32) -> Node {
        let slot = &mut self.slots[i as usize];
        slot.generation = slot.generation.wrapping_add(1);
        self.free_slots.push(i);
        self.node_count -= 1;
        slot.node.take().expect("freeing a live node")
    }

    fn id(&self, i: u32) -> NodeId {
        NodeId {
            index: i,
            generation: self.slots[i as usize].generation,
        }
    }

    fn resolve(&self, id: NodeId) -> Result<u32, RadixError> {
        match self.slots.get(id.index as usize) {
            Some(s) if s.generation == id.generation && s.node.is_some() => Ok(id.index),
            _ => Err(RadixError::StaleNode(id)),
        }
    }

    fn get(&self, i: u32) -> &Node {
        self.slots[i as usize]
            .node
            .as_ref()
            .expect("internal links point at live nodes")
    }

    fn get_mut(&mut self, i: u32) -> &mut Node {
        self.slots[i as usize]
            .node
            .as_mut()
            .expect("internal links point at live nodes")
    }

    fn nodes(&self) -> impl Iterator<Item = &Node> {
        self.slots.iter().filter_map(|s| s.node.as_ref())
    }
}

#[cfg(test)]
mod tests;
