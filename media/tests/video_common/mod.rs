//! Fixture access shared by the video tests (`media/tests/fixtures/video/`, written by
//! `tools/make_video_fixtures.py`).

#![allow(dead_code)] // each test binary uses a different subset

use std::path::PathBuf;

use serde_json::Value;

/// The fixture folder.
pub fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/video")
}

/// The path of one fixture.
pub fn path(name: &str) -> PathBuf {
    dir().join(name)
}

/// The bytes of one fixture.
pub fn bytes(name: &str) -> Vec<u8> {
    std::fs::read(path(name)).unwrap_or_else(|e| panic!("fixture {name}: {e}"))
}

/// `reference.json`.
pub fn reference() -> Value {
    serde_json::from_slice(&bytes("reference.json")).expect("reference.json parses")
}

/// A JSON array of integers.
pub fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("integer"))
        .collect()
}

/// A JSON array of numbers.
pub fn f64s(v: &Value) -> Vec<f64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().expect("number"))
        .collect()
}

/// Mean and largest absolute difference of two equal-length byte buffers.
pub fn diff(a: &[u8], b: &[u8]) -> (f64, u8) {
    assert_eq!(a.len(), b.len(), "buffers differ in length");
    let mut sum = 0u64;
    let mut max = 0u8;
    for (x, y) in a.iter().zip(b) {
        let d = x.abs_diff(*y);
        sum += u64::from(d);
        max = max.max(d);
    }
    (sum as f64 / a.len() as f64, max)
}
