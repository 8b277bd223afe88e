//! Helpers shared by the integration tests: fixture paths and reference
//! files, scratch folders, the SmolLM2 GGUF, and the real server binary as
//! a child process ([`serve`]), random tool schemas ([`schemas`]), and the
//! Server-Sent Events framing the socket-level clients read ([`take_sse_data`]).
//! (Deterministic test data comes from the one generator,
//! `caracal_kernels::testing`.)
//!
//! Each test file takes what it needs with `mod common;`; items a file does
//! not use are allowed to stay unused.

#![allow(dead_code)]

pub mod schemas;
pub mod serve;

use std::path::{Path, PathBuf};

use serde_json::Value;

/// `tests/fixtures/<name>`.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// A fixture's `expected.json` (reference outputs written by transformers).
pub fn expected(dir: &Path) -> Value {
    let path = dir.join("expected.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A JSON array of token ids.
pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("an array of ids")
        .iter()
        .map(|x| x.as_u64().expect("an id") as u32)
        .collect()
}

/// A JSON array of numbers as f32.
pub fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("an array of numbers")
        .iter()
        .map(|x| x.as_f64().expect("a number") as f32)
        .collect()
}

/// Largest elementwise |a - b| (the slices must have equal lengths).
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// A scratch folder under the system temp dir, unique to this process and
/// thread, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// A fresh, empty folder tagged `tag`.
    pub fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!(
            "caracal-test-{tag}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("create a scratch folder");
        TempDir(p)
    }

    /// The folder.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Copies the files of `src` (one level, as checkpoint folders are) into a
/// new scratch folder.
pub fn copy_dir(src: &Path, tag: &str) -> TempDir {
    let dst = TempDir::new(tag);
    for entry in std::fs::read_dir(src).expect("read the source folder") {
        let entry = entry.expect("a folder entry");
        if entry.file_type().expect("a file type").is_file() {
            std::fs::copy(entry.path(), dst.0.join(entry.file_name())).expect("copy a file");
        }
    }
    dst
}

/// SmolLM2-135M-Instruct's GGUF (`tools/fetch-models.sh`), or `None` with a
/// note on stderr saying which tests skip.
pub fn smollm2_gguf(what: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("CARACAL_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join(".cache/models"));
    let path = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.exists() {
        Some(path)
    } else {
        eprintln!(
            "note: skipping {what}: {} not found (run tools/fetch-models.sh)",
            path.display()
        );
        None
    }
}

/// Takes the next complete Server-Sent Events frame (up to a blank line) off the
/// front of `buf` and returns its `data:` lines joined; frames without data
/// (comments, keep-alives) are skipped. `None` when `buf` holds no complete frame
/// with data (read more bytes into it and call again).
pub fn take_sse_data(buf: &mut String) -> Option<String> {
    while let Some(end) = buf.find("\n\n") {
        let frame: String = buf.drain(..end + 2).collect();
        let data: String = frame
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .collect();
        if !data.is_empty() {
            return Some(data);
        }
    }
    None
}
