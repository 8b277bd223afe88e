//! Clients nobody here wrote, against the real `caracal serve` binary on the
//! built-in default model: the official `openai` Python SDK (chat
//! completions with tools and streaming, Responses over HTTP and over
//! `responses.connect()`, the Realtime client) and the `websockets` package
//! for raw frames and bad input (`tests/e2e/test_openai_sdk.py`), then a
//! graceful SIGTERM stop.
//!
//! The Python side comes from `.venv` (made by `.ci/run`, or by
//! `tests/e2e/run.sh`), or from `$CARACAL_E2E_PYTHON`; without a Python that
//! imports `openai`, `websockets` and `pytest` the test skips with a note.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

mod common;

use common::serve::ServeProcess;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A Python with the client packages, or `None`.
fn python() -> Option<PathBuf> {
    let py = std::env::var_os("CARACAL_E2E_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".venv/bin/python"));
    let ok = Command::new(&py)
        .args(["-c", "import openai, websockets, pytest"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if ok {
        Some(py)
    } else {
        eprintln!(
            "note: skipping the SDK end-to-end tests: {} cannot import openai, websockets and pytest \
             (run .ci/run or tests/e2e/run.sh to create .venv)",
            py.display()
        );
        None
    }
}

/// The served model name the SDK tests use.
const MODEL: &str = "moonshotai/kimi-k3-tiny";

#[test]
fn official_openai_sdk_and_raw_websockets_against_caracal_serve() {
    let Some(py) = python() else {
        return;
    };
    // A Hugging Face style id, so the SDKs send a `/` in bodies and in the
    // Realtime URL's `model=` query.
    let mut server = ServeProcess::start(&["--served-model-name", MODEL], 600);
    let port = server.port;
    let out = Command::new(&py)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .arg(Path::new("tests").join("e2e"))
        .current_dir(root())
        .env("CARACAL_BASE_URL", format!("http://127.0.0.1:{port}/v1"))
        .env("CARACAL_MODEL", MODEL)
        .output()
        .expect("run pytest");
    let report = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{report}");
    assert!(out.status.success(), "SDK tests failed:\n{report}");
    assert!(report.contains(" passed"), "{report}");
    // Graceful stop: SIGTERM, then the server says it stopped and exits 0.
    let pid = server.child.id().to_string();
    let killed = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(killed.success());
    assert!(
        server.wait_for("caracal serve: stopped", 120),
        "no stop line after SIGTERM:\n{}",
        server.log.join("\n")
    );
    let status = server.child.wait().expect("wait for the server");
    assert!(status.success(), "serve exited with {status}");
}
