//! `caracal generate --prompt-file`: a prompt read from a file is the same
//! prompt as `--prompt` with that text, long prompts go through chunked
//! prefill, and a missing file is a clear error.

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

fn caracal(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_caracal"))
        .arg("generate")
        .args(args)
        .output()
        .expect("caracal runs")
}

fn json_of(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("caracal-cli-generate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir.join(name)
}

#[test]
fn prompt_file_equals_prompt_and_takes_long_prompts() {
    let text = "The caracal is a medium-sized wild cat native to Africa. ".repeat(8);
    let path = scratch("short.txt");
    std::fs::write(&path, &text).unwrap();
    let common = ["--max-tokens", "4", "--ignore-eos", "--json"];
    let a = json_of(&caracal(&[&["--prompt", &text][..], &common].concat()));
    let file = path.to_str().unwrap();
    let b = json_of(&caracal(&[&["--prompt-file", file][..], &common].concat()));
    assert_eq!(a["prompt_tokens"], b["prompt_tokens"], "{a} vs {b}");
    assert_eq!(a["token_ids"], b["token_ids"], "{a} vs {b}");

    // Far past the chunked-prefill size (512) and any shell's argument limit per word.
    let long = "word ".repeat(6000);
    let path = scratch("long.txt");
    std::fs::write(&path, &long).unwrap();
    let v = json_of(&caracal(
        &[&["--prompt-file", path.to_str().unwrap()][..], &common].concat(),
    ));
    assert!(v["prompt_tokens"].as_u64().unwrap() >= 3000, "{v}");
    assert_eq!(v["token_ids"].as_array().unwrap().len(), 4, "{v}");
}

#[test]
fn missing_prompt_file_is_a_clear_error() {
    let out = caracal(&[
        "--prompt-file",
        "/nonexistent/prompt.txt",
        "--max-tokens",
        "1",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--prompt-file /nonexistent/prompt.txt"),
        "{err}"
    );
}
