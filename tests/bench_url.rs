//! `caracal bench --url` against the real `caracal serve` binary on the
//! tiny llama fixture: the serving scenario's JSON report counts every
//! request and the server's prompt tokens, and the agent-loop scenario's
//! follow-up turns carry cached prompt tokens (the conversation so far is
//! in the server's prefix cache). No timing assertions.

use std::path::PathBuf;
use std::process::Command;

mod common;

use common::serve::{free_port, ServeProcess};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `caracal serve` on the fixture, killed when dropped.
struct Server(ServeProcess);

impl Server {
    fn start() -> Server {
        let model = root().join("tests/fixtures/tiny-llama");
        Server(ServeProcess::start(
            &["--model", model.to_str().expect("a UTF-8 path")],
            300,
        ))
    }
}

#[test]
fn bench_url_serving_and_agent_loop_against_caracal_serve() {
    let server = Server::start();

    let r = server.0.bench(&[
        "--num-prompts",
        "4",
        "--input-len",
        "6",
        "--output-len",
        "5",
        "--concurrency",
        "1,2",
    ]);
    assert_eq!(r["scenario"], "serving");
    assert_eq!(r["model"], "tiny-llama", "the name from GET /v1/models");
    let levels = r["levels"].as_array().expect("levels");
    assert_eq!(levels.len(), 2);
    for (l, conc) in levels.iter().zip([1, 2]) {
        assert_eq!(l["concurrency"], conc);
        assert_eq!(l["completed"], 4, "{l}");
        assert_eq!(l["failed"], 0, "{l}");
        assert!(l["request_rate"].is_null(), "infinite rate is null");
        // ignore_eos: every request generates exactly --output-len tokens.
        assert_eq!(l["output_tokens"], 4 * 5, "{l}");
        // The prompt is the chat template around six words: more tokens than words.
        let prompt = l["prompt_tokens"].as_u64().expect("prompt tokens");
        assert!(prompt >= 4 * 6, "{l}");
        assert!(l["ttft_ms"]["p50"].as_f64().expect("ttft") > 0.0, "{l}");
        assert!(
            l["cached_tokens"].is_u64(),
            "caracal reports cached tokens: {l}"
        );
    }

    let r = server.0.bench(&[
        "--scenario",
        "agent-loop",
        "--sessions",
        "2",
        "--turns",
        "3",
        // Short turns: the conversation must stay inside the fixture's
        // 256-token context, or the server caps the last answers.
        "--input-len",
        "2",
        "--output-len",
        "3",
        "--tool-result-len",
        "2",
        "--model",
        "tiny-llama",
    ]);
    assert_eq!(r["scenario"], "agent-loop");
    let a = &r["agent_loop"];
    assert_eq!(a["sessions"], 2);
    assert_eq!(a["turns"], 3);
    assert_eq!(a["completed"], 6, "{a}");
    assert_eq!(a["failed"], 0, "{a}");
    assert_eq!(a["output_tokens"], 6 * 3, "{a}");
    assert_eq!(a["first_turn"]["requests"], 2, "{a}");
    let follow = &a["follow_up"];
    assert_eq!(follow["requests"], 4, "{a}");
    let cached = follow["cached_tokens"].as_u64().expect("cached tokens");
    let prompt = follow["prompt_tokens"].as_u64().expect("prompt tokens");
    assert!(
        cached > 0,
        "follow-up turns reuse the cached conversation: {a}"
    );
    assert!(cached <= prompt, "{a}");
    // Follow-ups resend the growing conversation: longer prompts than turn 1.
    let first_prompt = a["first_turn"]["prompt_tokens"].as_u64().expect("prompt");
    assert!(prompt > 2 * first_prompt, "{a}");
    let share = follow["cached_share"].as_f64().expect("share");
    assert!(share > 0.0 && share <= 1.0, "{a}");
}

#[test]
fn bench_url_reports_an_unreachable_server() {
    let port = free_port();
    let out = Command::new(env!("CARGO_BIN_EXE_caracal"))
        .args(["bench", "--url", &format!("http://127.0.0.1:{port}")])
        .args(["--num-prompts", "1", "--json"])
        .output()
        .expect("run caracal bench");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    // Normally "connecting to 127.0.0.1:PORT: refused"; if another process
    // grabbed the free port meanwhile, the error names the request instead.
    assert!(
        err.contains("connecting to 127.0.0.1") || err.contains(&format!("127.0.0.1:{port}")),
        "{err}"
    );
}
