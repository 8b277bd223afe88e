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

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

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

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// The server process, killed if the test fails before stopping it.
struct Server {
    child: Child,
    lines: mpsc::Receiver<String>,
    log: Vec<String>,
}

impl Server {
    fn start(port: u16) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_caracal"))
            .args(["serve", "--port", &port.to_string()])
            .args(["--served-model-name", "kimi-k3-tiny"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start caracal serve");
        let stderr = child.stderr.take().expect("piped stderr");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Server {
            child,
            lines,
            log: Vec::new(),
        }
    }

    /// Waits (up to `secs`) for a stderr line containing `needle`.
    fn wait_for(&mut self, needle: &str, secs: u64) -> bool {
        let deadline = std::time::Instant::now() + Duration::from_secs(secs);
        while let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) {
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    let hit = line.contains(needle);
                    self.log.push(line);
                    if hit {
                        return true;
                    }
                }
                Err(_) => return false,
            }
        }
        false
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn official_openai_sdk_and_raw_websockets_against_caracal_serve() {
    let Some(py) = python() else {
        return;
    };
    let port = free_port();
    let mut server = Server::start(port);
    assert!(
        server.wait_for("caracal serve: model", 600),
        "the server did not start:\n{}",
        server.log.join("\n")
    );
    let out = Command::new(&py)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .arg(Path::new("tests").join("e2e"))
        .current_dir(root())
        .env("CARACAL_BASE_URL", format!("http://127.0.0.1:{port}/v1"))
        .env("CARACAL_MODEL", "kimi-k3-tiny")
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
