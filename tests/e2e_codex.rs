//! Codex CLI (`@openai/codex` from npm) against the real `caracal serve`
//! binary: `codex exec` completes a turn with Caracal configured as a
//! custom Responses provider (`tests/e2e/codex/config.toml`), once over the
//! Responses WebSocket mode and once over plain HTTP SSE. Codex accepts a
//! turn only when it ends in `response.completed`, so the server runs a
//! trained model that stops by itself: SmolLM2-135M-Instruct, imported from
//! the GGUF that `tools/fetch-models.sh` downloads (the built-in default
//! model has random weights and runs to its token budget, which ends as
//! `response.incomplete`). The config trims Codex's instructions and tools
//! so its prompt fits SmolLM2's 8192-token context. What counts is that
//! Codex accepts every event and exits 0, and that the server's `/metrics`
//! show which transport carried the turn.
//!
//! Codex comes from `.e2e/node_modules/.bin/codex` (installed by `.ci/run`:
//! `npm install --prefix .e2e @openai/codex@<version>`) or from
//! `$CARACAL_E2E_CODEX`; without it, or without the GGUF, the test skips
//! with a note.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

mod common;

use common::serve::ServeProcess;

/// Longest a `codex exec` run may take before the test gives up on it.
const CODEX_TIMEOUT: Duration = Duration::from_secs(600);

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The Codex executable, or `None` with a note.
fn codex() -> Option<PathBuf> {
    let bin = std::env::var_os("CARACAL_E2E_CODEX")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".e2e/node_modules/.bin/codex"));
    let ok = Command::new(&bin)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if ok {
        Some(bin)
    } else {
        eprintln!(
            "note: skipping the Codex end-to-end test: {} does not run \
             (run .ci/run, or `npm install --prefix .e2e @openai/codex`)",
            bin.display()
        );
        None
    }
}

/// SmolLM2-135M-Instruct imported into `dir`, or `None` with a note.
fn smollm2(dir: &Path) -> Option<PathBuf> {
    let gguf = std::env::var_os("CARACAL_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".cache/models"))
        .join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if !gguf.is_file() {
        eprintln!(
            "note: skipping the Codex end-to-end test: no {} (run tools/fetch-models.sh)",
            gguf.display()
        );
        return None;
    }
    let out = dir.join("smollm2");
    let status = Command::new(env!("CARGO_BIN_EXE_caracal"))
        .arg("import-gguf")
        .arg(&gguf)
        .arg(&out)
        .status()
        .expect("run caracal import-gguf");
    assert!(status.success(), "import-gguf failed: {status}");
    Some(out)
}

/// The server, and what the test asks of it.
struct Server(ServeProcess);

impl std::ops::Deref for Server {
    type Target = ServeProcess;
    fn deref(&self) -> &ServeProcess {
        &self.0
    }
}

impl std::ops::DerefMut for Server {
    fn deref_mut(&mut self) -> &mut ServeProcess {
        &mut self.0
    }
}

impl Server {
    fn start(model: &Path) -> Server {
        let model = model.to_str().expect("a UTF-8 model path");
        Server(ServeProcess::start(
            &[
                "--model",
                model,
                "--served-model-name",
                "caracal-e2e",
                // Codex sends no temperature: greedy defaults make the turn
                // repeatable (SmolLM2 answers and stops instead of rambling).
                "--override-generation-config",
                r#"{"temperature": 0}"#,
            ],
            600,
        ))
    }

    /// `caracal_requests_total{endpoint="<endpoint>"}` from `/metrics`.
    fn requests(&self, endpoint: &str) -> u64 {
        let body = http_get(self.port, "/metrics");
        let key = format!("caracal_requests_total{{endpoint=\"{endpoint}\"}} ");
        body.lines()
            .find_map(|l| l.strip_prefix(&key))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .map(|v| v as u64)
            .unwrap_or_else(|| panic!("no {key} in /metrics:\n{body}"))
    }
}

/// A plain HTTP/1.1 GET; returns the body.
fn http_get(port: u16, path: &str) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .expect("send");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    let (head, body) = out.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(head.starts_with("HTTP/1.1 200"), "GET {path}: {head}");
    body.to_string()
}

/// A folder under cargo's temporary directory, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("e2e-codex-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create a scratch folder");
        Scratch(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A temporary `CODEX_HOME` with the test's config pointing at `port`.
fn codex_home(port: u16, websockets: bool) -> Scratch {
    let home = Scratch::new(if websockets { "home-ws" } else { "home-http" });
    let template =
        std::fs::read_to_string(root().join("tests/e2e/codex/config.toml")).expect("the config");
    let instructions = root().join("tests/e2e/codex/instructions.md");
    let config = template
        .replace("@BASE_URL@", &format!("http://127.0.0.1:{port}/v1"))
        .replace("@INSTRUCTIONS@", &instructions.display().to_string())
        .replace("@WEBSOCKETS@", if websockets { "true" } else { "false" });
    std::fs::write(home.path().join("config.toml"), config).expect("write config.toml");
    home
}

/// Runs `codex exec "say hi"` in a temporary folder; returns its exit
/// success and its output.
fn codex_exec(bin: &Path, home: &Path) -> (bool, String) {
    let work = Scratch::new("work");
    let mut child = Command::new(bin)
        .args(["exec", "--strict-config", "--skip-git-repo-check"])
        .args([
            "--dangerously-bypass-approvals-and-sandbox",
            "--color",
            "never",
        ])
        .args(["--model", "caracal-e2e", "Reply with the single word: hi"])
        .current_dir(work.path())
        .env("CODEX_HOME", home)
        .env_remove("OPENAI_API_KEY")
        .env_remove("OPENAI_BASE_URL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start codex");
    let mut stdout = child.stdout.take().expect("piped stdout");
    let mut stderr = child.stderr.take().expect("piped stderr");
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let deadline = std::time::Instant::now() + CODEX_TIMEOUT;
    let status = loop {
        if let Some(s) = child.try_wait().expect("poll codex") {
            break Some(s);
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let report = format!(
        "exit: {status:?}\n--- stdout\n{}\n--- stderr\n{}",
        out.join().unwrap_or_default(),
        err.join().unwrap_or_default()
    );
    (status.is_some_and(|s| s.success()), report)
}

#[test]
fn codex_exec_completes_a_turn_over_websocket_and_http() {
    let Some(bin) = codex() else {
        return;
    };
    let models = Scratch::new("models");
    let Some(model) = smollm2(models.path()) else {
        return;
    };
    let mut server = Server::start(&model);

    // WebSocket mode: a prewarm `generate: false` create and the turn,
    // chained by `previous_response_id` on one connection.
    let home = codex_home(server.port, true);
    let (ok, report) = codex_exec(&bin, home.path());
    eprintln!("{report}");
    assert!(
        ok,
        "codex exec over WebSocket failed:\n{report}\n--- server\n{}",
        server.drain_log()
    );
    let ws = server.requests("responses_ws");
    assert!(
        ws >= 2,
        "expected the prewarm and the turn over WebSocket, saw {ws} creates"
    );
    assert_eq!(
        server.requests("responses"),
        0,
        "Codex fell back to HTTP:\n{}",
        server.drain_log()
    );

    // Plain HTTP Responses (SSE): the same turn with WebSockets off.
    let home = codex_home(server.port, false);
    let (ok, report) = codex_exec(&bin, home.path());
    eprintln!("{report}");
    assert!(
        ok,
        "codex exec over HTTP failed:\n{report}\n--- server\n{}",
        server.drain_log()
    );
    assert!(
        server.requests("responses") >= 1,
        "no HTTP Responses request"
    );
    assert_eq!(
        server.requests("responses_ws"),
        ws,
        "the HTTP run used the WebSocket mode"
    );
}
