//! Model-file fuzzing helpers shared by `fuzz_checkpoint` (config.json,
//! safetensors) and `fuzz_gguf`: the committed fixtures, a scratch folder
//! per case, and how a real file is damaged (cut, bytes overwritten, absurd
//! little-endian counts written into its header).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use proptest::prelude::*;

/// A committed fixture under `tests/fixtures`.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// A fresh scratch folder for one case.
pub fn scratch() -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let d = std::env::temp_dir().join(format!(
        "caracal-fuzz-files-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("scratch dir");
    d
}

/// How a real file is damaged: cut at a fraction of its length, bytes
/// overwritten (offset as a fraction of the length, value), and little-endian
/// u64s written at offsets (the counts and lengths of a header).
#[derive(Debug, Clone)]
pub struct Damage {
    pub cut: Option<u16>,
    pub bytes: Vec<(u16, u8)>,
    pub words: Vec<(u16, u64)>,
}

pub fn damage(header_bias: bool) -> impl Strategy<Value = Damage> {
    let word = prop_oneof![
        Just(u64::MAX),
        Just(u64::MAX / 2),
        Just(1u64 << 32),
        Just(1u64 << 40),
        Just(0u64),
        Just(1u64),
        Just(9u64),
        any::<u64>(),
    ];
    let at = if header_bias {
        0u16..2048
    } else {
        0u16..u16::MAX
    };
    (
        prop::option::of(any::<u16>()),
        prop::collection::vec((at.clone(), any::<u8>()), 0..8),
        prop::collection::vec((at, word), 0..4),
    )
        .prop_map(|(cut, bytes, words)| Damage { cut, bytes, words })
}

/// `orig` with `d` applied; `header_bias` places offsets in the first
/// 2048 bytes (where the header is) rather than anywhere.
pub fn damaged(orig: &[u8], d: &Damage, header_bias: bool) -> Vec<u8> {
    let mut b = orig.to_vec();
    let pos = |x: u16, len: usize| {
        if header_bias {
            x as usize % len.max(1)
        } else {
            (x as usize * len) / (u16::MAX as usize + 1)
        }
    };
    for &(at, v) in &d.bytes {
        let i = pos(at, b.len());
        if i < b.len() {
            b[i] = v;
        }
    }
    for &(at, w) in &d.words {
        let i = pos(at, b.len());
        if i + 8 <= b.len() {
            b[i..i + 8].copy_from_slice(&w.to_le_bytes());
        }
    }
    if let Some(c) = d.cut {
        let keep = (c as usize * b.len()) / (u16::MAX as usize + 1);
        b.truncate(keep);
    }
    b
}
