//! Tests of the radix prefix cache: matching, insertion, locking, eviction
//! (LRU and by prefix) and recurrent-state snapshot boundaries.

use super::*;

fn tree(page_size: usize) -> RadixCache {
    RadixCache::new(page_size).expect("page_size > 0")
}

fn ok(t: &RadixCache) {
    t.check_invariants().expect("invariants hold");
}

#[test]
fn match_returns_whole_pages_only() {
    let mut t = tree(4);
    // 10 tokens: two whole pages are stored, the trailing 2 tokens are not.
    let key: Vec<u64> = (1..=10).collect();
    let r = t.insert(&key, &[100, 101]).expect("2 pages for 10 tokens");
    assert_eq!((r.new_pages, t.cached_pages(), t.total_tokens()), (2, 2, 8));
    let m = t.match_prefix(&key);
    assert_eq!((m.tokens, m.pages), (8, vec![100, 101]));
    let m = t.match_prefix(&key[..7]);
    assert_eq!((m.tokens, m.pages), (4, vec![100]));
    let m = t.match_prefix(&key[..3]);
    assert_eq!((m.tokens, m.pages, m.node), (0, vec![], t.root()));
    // Diverging inside the second page keeps only the first page.
    let m = t.match_prefix(&[1, 2, 3, 4, 5, 6, 99, 8]);
    assert_eq!((m.tokens, m.pages), (4, vec![100]));
    ok(&t);
}

#[test]
fn insert_returns_duplicate_pages() {
    let mut t = tree(2);
    t.insert(&[1, 2, 3, 4], &[10, 11]).expect("pages match");
    let r = t
        .insert(&[1, 2, 3, 9, 5, 6], &[20, 21, 22])
        .expect("pages match");
    assert_eq!((r.duplicate_pages, r.new_pages), (vec![20], 2));
    let r = t.insert(&[1, 2, 3, 4], &[30, 31]).expect("pages match");
    assert_eq!((r.duplicate_pages, r.new_pages), (vec![30, 31], 0));
    assert_eq!(t.cached_pages(), 4);
    let m = t.match_prefix(&[1, 2, 3, 9, 5, 6]);
    assert_eq!(
        m.pages,
        vec![10, 21, 22],
        "the tree kept its own first page"
    );
    assert_eq!(
        t.insert(&[1, 2, 3], &[]),
        Err(RadixError::PageCountMismatch {
            tokens: 3,
            page_size: 2,
            expected: 1,
            got: 0
        })
    );
    ok(&t);
}

#[test]
fn evicts_unlocked_leaf_first() {
    let mut t = tree(1);
    t.insert(&[1, 2], &[10, 11]).expect("pages match");
    t.insert(&[3, 4], &[30, 31]).expect("pages match");
    t.insert(&[5, 6], &[50, 51]).expect("pages match");
    t.match_prefix(&[1, 2]); // [1,2] becomes most recent: order is [3,4], [5,6], [1,2]
    assert_eq!(
        t.evict(1).pages,
        vec![30, 31],
        "whole leaves go, oldest first"
    );
    assert_eq!(t.evict(2).pages, vec![50, 51]);
    assert_eq!(t.evict(2).pages, vec![10, 11]);
    assert_eq!((t.cached_pages(), t.node_count()), (0, 0));
    // A parent becomes evictable when its last child goes, in the same call.
    t.insert(&[1, 2, 3], &[1, 2, 3]).expect("pages match");
    t.insert(&[1, 2, 4], &[1, 2, 4]).expect("pages match"); // [1,2] are duplicates
    let ev = t.evict(3);
    assert_eq!(
        ev.pages,
        vec![3, 4, 1, 2],
        "leaf [3], leaf [4], then their parent [1,2]"
    );
    ok(&t);
}

#[test]
fn evict_prefix_drops_unlocked_extensions_only() {
    let mut t = tree(2);
    // Shared head [1,2], then two branches; a third branch is locked.
    t.insert(&[1, 2, 3, 4, 5, 6], &[10, 11, 12]).unwrap();
    let b = t.insert(&[1, 2, 3, 4, 7, 8], &[10, 11, 13]).unwrap();
    t.insert(&[1, 2, 9, 9], &[10, 14]).unwrap();
    t.lock(b.node).unwrap();
    t.set_snapshot(&[1, 2, 3, 4, 5, 6], 77).unwrap();
    ok(&t);
    // Everything extending [1,2,3,4]: the [5,6] branch goes, the locked [7,8] stays.
    let ev = t.evict_prefix(&[1, 2, 3, 4, 99]);
    assert_eq!(ev.pages, [12]);
    assert_eq!(ev.snapshots, [77]);
    ok(&t);
    assert_eq!(t.match_prefix(&[1, 2, 3, 4, 7, 8]).tokens, 6);
    assert_eq!(t.match_prefix(&[1, 2, 9, 9]).tokens, 4, "other branch kept");
    // Unlocked, the [3,4] subtree goes whole, the head [1,2] stays.
    t.unlock(b.node).unwrap();
    let mut ev = t.evict_prefix(&[1, 2, 3, 4]);
    ev.pages.sort_unstable();
    assert_eq!(ev.pages, [11, 13]);
    ok(&t);
    assert_eq!(t.cached_pages(), 2);
    assert_eq!(t.evictable_pages(), 2);
    assert!(
        t.evict_prefix(&[5, 5]).pages.is_empty(),
        "nothing extends it"
    );
    assert!(t.evict_prefix(&[1]).pages.is_empty(), "no whole page");
}

#[test]
fn locked_path_is_never_evicted() {
    let mut t = tree(1);
    t.insert(&[1, 2, 3, 4], &[1, 2, 3, 4]).expect("pages match");
    t.insert(&[1, 2, 5, 6], &[2, 2, 5, 6].map(|p| p + 100))
        .expect("pages match");
    let m = t.match_prefix(&[1, 2, 3, 4]);
    t.lock(m.node).expect("live node");
    assert_eq!(t.evictable_pages(), 2, "only [5,6] is unlocked");
    let ev = t.evict(100);
    assert_eq!(ev.pages, vec![105, 106]);
    assert_eq!(t.evict(100), Evicted::default());
    assert_eq!(t.match_prefix(&[1, 2, 3, 4]).pages, vec![1, 2, 3, 4]);
    t.unlock(m.node).expect("locked once");
    assert_eq!(t.unlock(m.node), Err(RadixError::NotLocked(m.node)));
    assert_eq!(t.evict(100).pages.len(), 4);
    assert_eq!(t.lock(m.node), Err(RadixError::StaleNode(m.node)));
    ok(&t);
}

#[test]
fn match_splits_so_lock_covers_only_matched_pages() {
    let mut t = tree(1);
    t.insert(&[1, 2, 3, 4], &[1, 2, 3, 4]).expect("pages match");
    let m = t.match_prefix(&[1, 2, 9]);
    assert_eq!((m.tokens, t.node_count()), (2, 2));
    t.lock(m.node).expect("live node");
    assert_eq!(t.lock_ref(t.root()), Ok(1));
    let mut ev = t.evict(10).pages;
    ev.sort_unstable();
    assert_eq!(ev, vec![3, 4]);
    ok(&t);
}

#[test]
fn snapshot_hit_only_at_written_boundary() {
    let mut t = tree(2);
    let key: Vec<u64> = (1..=8).collect();
    t.insert(&key, &[1, 2, 3, 4]).expect("pages match");
    assert_eq!(
        t.match_prefix_with_snapshot(&key),
        None,
        "nothing written yet"
    );
    assert_eq!(t.set_snapshot(&key[..4], 77), Ok(None));
    // The full 8 tokens are cached, but the KDA state exists only after 4.
    assert_eq!(t.match_prefix(&key).tokens, 8);
    let s = t.match_prefix_with_snapshot(&key).expect("boundary at 4");
    assert_eq!((s.tokens, s.pages, s.snapshot), (4, vec![1, 2], 77));
    let s = t
        .match_prefix_with_snapshot(&[1, 2, 3, 4, 5, 9])
        .expect("boundary at 4");
    assert_eq!(s.tokens, 4);
    assert_eq!(
        t.match_prefix_with_snapshot(&[1, 2, 3]),
        None,
        "prefix shorter than the boundary"
    );
    assert_eq!(t.match_prefix_with_snapshot(&[1, 2, 9, 9, 5, 6]), None);
    assert_eq!(t.set_snapshot(&key, 78), Ok(None));
    assert_eq!(
        t.match_prefix_with_snapshot(&key)
            .map(|s| (s.tokens, s.snapshot)),
        Some((8, 78))
    );
    ok(&t);
}

#[test]
fn split_preserves_pages_and_snapshots() {
    let mut t = tree(2);
    let key: Vec<u64> = (1..=8).collect();
    let r = t.insert(&key, &[1, 2, 3, 4]).expect("pages match");
    t.lock(r.node).expect("live node");
    assert_eq!(t.set_snapshot(&key, 8), Ok(None));
    assert_eq!(t.set_snapshot(&key[..4], 4), Ok(None)); // splits the node at 4
    assert_eq!(t.node_count(), 2);
    t.insert(&[1, 2, 9, 9], &[20, 21]).expect("pages match"); // splits again at 2
    assert_eq!(t.node_count(), 4);
    assert_eq!(t.match_prefix(&key).pages, vec![1, 2, 3, 4]);
    let s = t.match_prefix_with_snapshot(&key).expect("snapshot at 8");
    assert_eq!(
        (s.tokens, s.snapshot, s.node),
        (8, 8, r.node),
        "the handle still names the end"
    );
    let s = t
        .match_prefix_with_snapshot(&key[..6])
        .expect("snapshot at 4");
    assert_eq!((s.tokens, s.pages, s.snapshot), (4, vec![1, 2], 4));
    assert_eq!(
        t.lock_ref(s.node),
        Ok(1),
        "the split head inherited the lock"
    );
    assert_eq!(
        t.set_snapshot(&key[..4], 5),
        Ok(Some(4)),
        "replaced id comes back"
    );
    t.unlock(r.node).expect("locked once");
    ok(&t);
    let mut ev = t.evict(usize::MAX);
    ev.pages.sort_unstable();
    ev.snapshots.sort_unstable();
    assert_eq!((ev.pages, ev.snapshots), (vec![1, 2, 3, 4, 21], vec![5, 8]));
}

#[test]
fn set_snapshot_rejects_bad_boundary_without_changing_tree() {
    let mut t = tree(2);
    t.insert(&[1, 2, 3, 4], &[1, 2]).expect("pages match");
    let err = |tokens, cached| Err(RadixError::NotCached { tokens, cached });
    assert_eq!(
        t.set_snapshot(&[1, 2, 3], 1),
        Err(RadixError::NotPageAligned {
            tokens: 3,
            page_size: 2
        })
    );
    assert_eq!(t.set_snapshot(&[], 1), Err(RadixError::EmptyBoundary));
    assert_eq!(t.set_snapshot(&[1, 2, 3, 4, 5, 6], 1), err(6, 4));
    assert_eq!(t.set_snapshot(&[1, 2, 9, 9], 1), err(4, 2));
    assert_eq!(t.set_snapshot(&[9, 9], 1), err(2, 0));
    assert_eq!((t.node_count(), t.snapshot_ids()), (1, vec![]));
    assert_eq!(RadixCache::new(0).err(), Some(RadixError::ZeroPageSize));
    ok(&t);
}
