//! Property tests of the radix cache and page allocator, modelling how
//! SessionMemory uses them: thousands of random admissions, growth, snapshots,
//! finishes and cancellations per case, with every invariant checked per step
//! and no page, lock or snapshot left at the end; and a brute-force model of
//! longest-prefix matching.

use caracal_actors::pages::{PageAllocator, PagesError};
use caracal_actors::radix::*;
use proptest::prelude::*;
use std::collections::hash_map::Entry;
use std::collections::HashMap;

fn tree(page_size: usize) -> RadixCache {
    RadixCache::new(page_size).expect("page_size > 0")
}

fn ok(t: &RadixCache) {
    t.check_invariants().expect("radix invariants hold");
}

/// A key drawn as `bases[base][..take] ++ suffix`: bases make shared prefixes common.
type KeySpec = (usize, usize, Vec<u64>);

fn key_spec(alphabet: u64) -> impl Strategy<Value = KeySpec> {
    (
        0..4usize,
        0..=16usize,
        prop::collection::vec(0..alphabet, 0..7),
    )
}

fn make_key(bases: &[Vec<u64>], (b, take, suffix): &KeySpec) -> Vec<u64> {
    let mut k = bases[b % bases.len()][..*take].to_vec();
    k.extend_from_slice(suffix);
    k
}

fn bases(alphabet: u64) -> impl Strategy<Value = Vec<Vec<u64>>> {
    prop::collection::vec(prop::collection::vec(0..alphabet, 16), 4)
}

#[derive(Debug, Clone)]
enum SimOp {
    /// Admit a request; `hybrid` matches only at snapshot boundaries.
    Admit(KeySpec, bool),
    /// A running request decodes more tokens.
    Grow(usize, Vec<u64>),
    /// A running request writes a snapshot at a page boundary of its cached prefix.
    Snapshot(usize, usize),
    /// A running request finishes and is inserted.
    Finish(usize, usize),
    /// A running request is cancelled.
    Cancel(usize),
}

fn sim_op() -> impl Strategy<Value = SimOp> {
    prop_oneof![
        4 => (key_spec(3), any::<bool>()).prop_map(|(k, h)| SimOp::Admit(k, h)),
        2 => (any::<usize>(), prop::collection::vec(0..3u64, 1..6))
            .prop_map(|(i, t)| SimOp::Grow(i, t)),
        1 => (any::<usize>(), any::<usize>()).prop_map(|(i, b)| SimOp::Snapshot(i, b)),
        3 => (any::<usize>(), any::<usize>()).prop_map(|(i, b)| SimOp::Finish(i, b)),
        1 => any::<usize>().prop_map(SimOp::Cancel),
    ]
}

/// A running request: its key, its locked node, and one page per started page of
/// its key (matched pages it retained, then pages it allocated).
struct Req {
    key: Vec<u64>,
    node: NodeId,
    cached: usize,
    pages: Vec<u32>,
}

/// SessionMemory's use of the pool and tree, with every invariant checked per step.
struct Sim {
    alloc: PageAllocator,
    tree: RadixCache,
    running: Vec<Req>,
    /// Live snapshot id -> the prefix whose state it holds.
    live: HashMap<SnapshotId, Vec<u64>>,
    next_snapshot: SnapshotId,
}

impl Sim {
    fn kill_snapshots(&mut self, ids: &[SnapshotId]) {
        for id in ids {
            assert!(
                self.live.remove(id).is_some(),
                "snapshot {id} reported dead twice"
            );
        }
    }

    fn snapshot(&mut self, prefix: &[u64]) {
        let id = self.next_snapshot;
        self.next_snapshot += 1;
        let old = self
            .tree
            .set_snapshot(prefix, id)
            .expect("boundary is cached");
        self.kill_snapshots(&old.into_iter().collect::<Vec<_>>());
        self.live.insert(id, prefix.to_vec());
    }

    /// Allocates `n` pages, evicting from the tree when the pool is short.
    fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        match self.alloc.alloc(n) {
            Ok(p) => Some(p),
            Err(PagesError::OutOfPages { needed, free }) => {
                let ev = self.tree.evict(needed - free);
                let freed = self.alloc.release(&ev.pages);
                assert_eq!(freed, ev.pages.len(), "an evicted page was still in use");
                self.kill_snapshots(&ev.snapshots);
                self.alloc.alloc(n).ok()
            }
        }
    }

    fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.tree.page_size())
    }

    fn admit(&mut self, key: Vec<u64>, hybrid: bool) {
        let (node, tokens, matched) = if hybrid {
            match self.tree.match_prefix_with_snapshot(&key) {
                Some(s) => {
                    assert_eq!(
                        self.live[&s.snapshot],
                        key[..s.tokens],
                        "snapshot of another prefix"
                    );
                    (s.node, s.tokens, s.pages)
                }
                None => (self.tree.root(), 0, vec![]),
            }
        } else {
            let m = self.tree.match_prefix(&key);
            (m.node, m.tokens, m.pages)
        };
        self.tree.lock(node).expect("matched node is live");
        self.alloc.retain(&matched);
        match self.alloc(self.pages_for(key.len()) - matched.len()) {
            Some(own) => {
                let pages = [matched, own].concat();
                self.running.push(Req {
                    key,
                    node,
                    cached: tokens,
                    pages,
                });
            }
            None => {
                self.tree.unlock(node).expect("locked above");
                assert_eq!(self.alloc.release(&matched), 0, "the tree still holds them");
            }
        }
    }

    fn finish(&mut self, i: usize, boundary: usize) {
        let r = self.running.swap_remove(i);
        let whole = r.key.len() / self.tree.page_size();
        let ins = self
            .tree
            .insert(&r.key, &r.pages[..whole])
            .expect("page count");
        self.alloc.release(&ins.duplicate_pages);
        self.tree.unlock(r.node).expect("locked at admit");
        self.alloc.release(&r.pages[whole..]);
        if whole > 0 {
            let ps = self.tree.page_size();
            self.snapshot(&r.key[..whole * ps]);
            self.snapshot(&r.key[..(1 + boundary % whole) * ps]);
        }
    }

    fn cancel(&mut self, i: usize) {
        let r = self.running.swap_remove(i);
        self.tree.unlock(r.node).expect("locked at admit");
        self.alloc.release(&r.pages);
    }

    fn step(&mut self, bases: &[Vec<u64>], op: &SimOp) {
        let n = self.running.len();
        match op {
            SimOp::Admit(k, hybrid) => self.admit(make_key(bases, k), *hybrid),
            SimOp::Grow(i, toks) if n > 0 => {
                let i = i % n;
                let len = self.running[i].key.len() + toks.len();
                let need = self.pages_for(len) - self.running[i].pages.len();
                match self.alloc(need) {
                    Some(p) => {
                        self.running[i].key.extend_from_slice(toks);
                        self.running[i].pages.extend(p);
                    }
                    None => self.cancel(i), // preempted: out of memory
                }
            }
            SimOp::Snapshot(i, b) if n > 0 => {
                let r = &self.running[i % n];
                let cached_pages = r.cached / self.tree.page_size();
                if cached_pages > 0 {
                    let prefix = r.key[..(1 + b % cached_pages) * self.tree.page_size()].to_vec();
                    self.snapshot(&prefix);
                }
            }
            SimOp::Finish(i, b) if n > 0 => self.finish(i % n, *b),
            SimOp::Cancel(i) if n > 0 => self.cancel(i % n),
            _ => {}
        }
    }

    /// Every page's reference count equals its holders: the tree plus each request.
    fn check_refcounts(&self) {
        let mut expected = vec![0u32; self.alloc.num_pages()];
        for p in self.tree.owned_pages() {
            expected[p as usize] += 1;
        }
        for r in &self.running {
            for &p in &r.pages {
                expected[p as usize] += 1;
            }
        }
        for (p, &e) in expected.iter().enumerate() {
            assert_eq!(self.alloc.refcount(p as u32), e, "refcount of page {p}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Random admits, decodes, snapshots, finishes and cancels over a small pool:
    /// refcounts always equal holders; afterwards no lock, page or snapshot leaks.
    #[test]
    fn session_simulation_leaks_no_pages_locks_or_snapshots(
        page_size in 1..=4usize,
        num_pages in 6..160u32,
        bases in bases(3),
        ops in prop::collection::vec(sim_op(), 1..400),
        ends in prop::collection::vec(any::<bool>(), 64),
    ) {
        let mut sim = Sim {
            alloc: PageAllocator::new(num_pages),
            tree: tree(page_size),
            running: Vec::new(),
            live: HashMap::new(),
            next_snapshot: 0,
        };
        for op in &ops {
            sim.step(&bases, op);
            ok(&sim.tree);
            sim.check_refcounts();
        }
        let mut j = 0;
        while !sim.running.is_empty() {
            if ends[j % ends.len()] { sim.finish(0, j) } else { sim.cancel(0) }
            j += 1;
        }
        ok(&sim.tree);
        sim.check_refcounts();
        prop_assert_eq!(sim.tree.lock_ref(sim.tree.root()), Ok(0));
        prop_assert_eq!(sim.tree.evictable_pages(), sim.tree.cached_pages());
        let owned = sim.tree.owned_pages();
        prop_assert_eq!(sim.alloc.free_count() + owned.len(), num_pages as usize);
        prop_assert!(owned.iter().all(|&p| sim.alloc.refcount(p) == 1));
        let mut in_tree = sim.tree.snapshot_ids();
        in_tree.sort_unstable();
        let mut live: Vec<_> = sim.live.keys().copied().collect();
        live.sort_unstable();
        prop_assert_eq!(in_tree, live);
        let ev = sim.tree.evict(usize::MAX);
        prop_assert_eq!(sim.alloc.release(&ev.pages), owned.len());
        sim.kill_snapshots(&ev.snapshots);
        prop_assert!(sim.live.is_empty());
        prop_assert_eq!(sim.alloc.free_count(), num_pages as usize);
        prop_assert_eq!(sim.tree.node_count(), 0);
    }

    /// `match_prefix`, `match_prefix_with_snapshot`, `insert`, `set_snapshot` and
    /// `evict` agree with a brute-force model: the set of cached whole-page prefixes
    /// (each with its page and maybe a snapshot), matched by longest common prefix.
    #[test]
    fn tree_agrees_with_brute_force_prefix_model(
        page_size in 1..=3usize,
        bases in bases(2),
        ops in prop::collection::vec(model_op(), 1..300),
    ) {
        let mut t = tree(page_size);
        let mut m = Model { ps: page_size, ..Model::default() };
        let (mut next_page, mut next_snap) = (0u32, 0u64);
        for op in &ops {
            match op {
                ModelOp::Insert(k) => {
                    let key = make_key(&bases, k);
                    let n = key.len() / page_size;
                    let pages: Vec<u32> = (next_page..next_page + n as u32).collect();
                    next_page += n as u32;
                    let mut dup = Vec::new();
                    for (j, &p) in pages.iter().enumerate() {
                        match m.pages.entry(key[..(j + 1) * page_size].to_vec()) {
                            Entry::Occupied(_) => dup.push(p),
                            Entry::Vacant(v) => {
                                v.insert(p);
                            }
                        }
                    }
                    let r = t.insert(&key, &pages).expect("page count");
                    prop_assert_eq!(r.new_pages, n - dup.len());
                    prop_assert_eq!(r.duplicate_pages, dup);
                }
                ModelOp::Match(k, lock) => {
                    let key = make_key(&bases, k);
                    let (tokens, pages) = m.longest(&key);
                    let r = t.match_prefix(&key);
                    prop_assert_eq!((r.tokens, &r.pages), (tokens, &pages));
                    if *lock {
                        t.lock(r.node).expect("live node");
                        m.locks.push((r.node, key[..tokens].to_vec()));
                    }
                }
                ModelOp::MatchSnapshot(k) => {
                    let key = make_key(&bases, k);
                    let want = m.longest_with_snapshot(&key);
                    let got = t
                        .match_prefix_with_snapshot(&key)
                        .map(|s| (s.tokens, s.pages, s.snapshot));
                    prop_assert_eq!(got, want);
                }
                ModelOp::SetSnapshot(k, cut) => {
                    let key = make_key(&bases, k);
                    let b = (cut % (key.len() / page_size + 1)) * page_size;
                    let (cached, _) = m.longest(&key[..b]);
                    let want = if b == 0 {
                        Err(RadixError::EmptyBoundary)
                    } else if cached < b {
                        Err(RadixError::NotCached { tokens: b, cached })
                    } else {
                        Ok(m.snapshots.insert(key[..b].to_vec(), next_snap))
                    };
                    prop_assert_eq!(t.set_snapshot(&key[..b], next_snap), want);
                    next_snap += 1;
                }
                ModelOp::Evict(n) => {
                    let before = t.evictable_pages();
                    let ev = t.evict(*n);
                    prop_assert!(ev.pages.len() >= (*n).min(before));
                    let mut dead = Vec::new();
                    for p in &ev.pages {
                        let prefix = m.prefix_of(*p).expect("evicted page was cached");
                        prop_assert!(!m.is_locked(&prefix), "locked page evicted");
                        dead.extend(m.snapshots.remove(&prefix));
                        m.pages.remove(&prefix);
                    }
                    let mut got = ev.snapshots.clone();
                    got.sort_unstable();
                    dead.sort_unstable();
                    prop_assert_eq!(got, dead);
                    // Leaves went first: what remains is still closed under prefixes.
                    for prefix in m.pages.keys() {
                        let parent = &prefix[..prefix.len() - page_size];
                        prop_assert!(parent.is_empty() || m.pages.contains_key(parent));
                    }
                }
                ModelOp::Unlock(i) if !m.locks.is_empty() => {
                    let (node, _) = m.locks.swap_remove(i % m.locks.len());
                    t.unlock(node).expect("locked by this model");
                }
                ModelOp::Unlock(_) => {}
            }
            ok(&t);
            prop_assert_eq!(t.cached_pages(), m.pages.len());
            let locked = m.pages.keys().filter(|p| m.is_locked(p)).count();
            prop_assert_eq!(t.evictable_pages(), m.pages.len() - locked);
        }
        for (node, _) in m.locks.drain(..) {
            t.unlock(node).expect("locked by this model");
        }
        prop_assert_eq!(t.lock_ref(t.root()), Ok(0));
        let ev = t.evict(usize::MAX);
        prop_assert_eq!(ev.pages.len(), m.pages.len());
        prop_assert_eq!(ev.snapshots.len(), m.snapshots.len());
        prop_assert_eq!((t.cached_pages(), t.node_count()), (0, 0));
    }
}

#[derive(Debug, Clone)]
enum ModelOp {
    Insert(KeySpec),
    /// Match, and lock the matched node when the flag is set.
    Match(KeySpec, bool),
    MatchSnapshot(KeySpec),
    /// Snapshot at `cut % (whole pages + 1)` pages of the key.
    SetSnapshot(KeySpec, usize),
    Evict(usize),
    Unlock(usize),
}

fn model_op() -> impl Strategy<Value = ModelOp> {
    prop_oneof![
        4 => key_spec(2).prop_map(ModelOp::Insert),
        3 => (key_spec(2), any::<bool>()).prop_map(|(k, l)| ModelOp::Match(k, l)),
        2 => key_spec(2).prop_map(ModelOp::MatchSnapshot),
        2 => (key_spec(2), any::<usize>()).prop_map(|(k, c)| ModelOp::SetSnapshot(k, c)),
        1 => (0..12usize).prop_map(ModelOp::Evict),
        2 => any::<usize>().prop_map(ModelOp::Unlock),
    ]
}

/// Brute-force model of the tree: every cached whole-page prefix with its last page.
#[derive(Default)]
struct Model {
    ps: usize,
    /// Cached prefix (a non-zero multiple of `ps` long) -> the page holding its last page.
    pages: HashMap<Vec<u64>, u32>,
    /// Prefix -> snapshot written there.
    snapshots: HashMap<Vec<u64>, SnapshotId>,
    /// Locked nodes and the prefix each ends at.
    locks: Vec<(NodeId, Vec<u64>)>,
}

impl Model {
    /// Longest common prefix of `key` with any cached prefix, rounded down to pages,
    /// and the pages backing it.
    fn longest(&self, key: &[u64]) -> (usize, Vec<u32>) {
        let lcp = |p: &Vec<u64>| p.iter().zip(key).take_while(|(a, b)| a == b).count();
        let tokens = self.pages.keys().map(lcp).max().unwrap_or(0) / self.ps * self.ps;
        let pages = (1..=tokens / self.ps)
            .map(|j| self.pages[&key[..j * self.ps]])
            .collect();
        (tokens, pages)
    }

    fn longest_with_snapshot(&self, key: &[u64]) -> Option<(usize, Vec<u32>, SnapshotId)> {
        let (tokens, mut pages) = self.longest(key);
        let j = (1..=tokens / self.ps)
            .rev()
            .find(|j| self.snapshots.contains_key(&key[..j * self.ps]))?;
        pages.truncate(j);
        Some((j * self.ps, pages, self.snapshots[&key[..j * self.ps]]))
    }

    /// Whether `prefix` lies on the path of a locked node.
    fn is_locked(&self, prefix: &[u64]) -> bool {
        self.locks.iter().any(|(_, l)| l.starts_with(prefix))
    }

    fn prefix_of(&self, page: u32) -> Option<Vec<u64>> {
        self.pages
            .iter()
            .find(|(_, &p)| p == page)
            .map(|(k, _)| k.clone())
    }
}
