//! The web console in a real browser: headless Chromium (Debian's
//! `chromium`) driven by `playwright-core` runs `tests/e2e/console.mjs`
//! against the real `caracal serve` binary on the built-in default model
//! (with `--api-key`, which the page sends as the WebSocket subprotocol):
//! a generated MP4 clip picked with `setInputFiles` and streamed, the
//! webcam path fed by Chromium's fake capture device from a generated
//! `.y4m` clip, a question and its response, and no page errors; then a
//! second server on the tiny llama fixture (a model that answers in text
//! rather than reasoning) for a streamed answer.
//!
//! Needs `chromium` (or `$CHROMIUM`), `node`, `ffmpeg` and
//! `.e2e/node_modules/playwright-core` (`.ci/run` installs them); without
//! one of them the test skips with a note. `CONSOLE_SCREENSHOT=path.png`
//! saves a screenshot of the console (`docs/console.png` is made so).

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;

use common::serve::ServeProcess;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Whether `cmd <version flag>` runs.
fn runs(cmd: &str, flag: &str) -> bool {
    Command::new(cmd)
        .arg(flag)
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// Chromium, node and playwright-core, or a note saying which is missing.
fn tools() -> Result<(PathBuf, PathBuf), String> {
    let chromium = std::env::var_os("CHROMIUM")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/chromium"));
    if !chromium.exists() {
        return Err(format!(
            "{} is missing (apt-get install chromium)",
            chromium.display()
        ));
    }
    let playwright = root().join(".e2e/node_modules/playwright-core");
    if !playwright.join("package.json").exists() {
        return Err(format!(
            "{} is missing (npm install --prefix .e2e playwright-core@1.65.1)",
            playwright.display()
        ));
    }
    for (tool, flag) in [("node", "--version"), ("ffmpeg", "-version")] {
        if !runs(tool, flag) {
            return Err(format!("`{tool}` is not on PATH"));
        }
    }
    Ok((chromium, playwright))
}

/// Makes `out` with the `ffmpeg` CLI from a lavfi test source.
fn ffmpeg(args: &[&str], out: &Path) {
    let status = Command::new("ffmpeg")
        .args(["-hide_banner", "-loglevel", "error", "-y"])
        .args(args)
        .arg(out)
        .status()
        .expect("run ffmpeg");
    assert!(status.success(), "ffmpeg failed making {}", out.display());
}

#[test]
fn console_streams_a_file_and_the_webcam_and_answers_in_chromium() {
    let (chromium, playwright) = match tools() {
        Ok(t) => t,
        Err(why) => {
            eprintln!("note: skipping the console browser test: {why}");
            return;
        }
    };
    let dir = std::env::temp_dir().join(format!("caracal-console-e2e-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // 3 s at 10 fps, H.264 in MP4 (what a phone or a screen recorder gives).
    let clip = dir.join("clip.mp4");
    ffmpeg(
        &[
            "-f",
            "lavfi",
            "-i",
            "testsrc=size=320x240:rate=10",
            "-t",
            "3",
            "-c:v",
            "libx264",
            "-pix_fmt",
            "yuv420p",
            "-movflags",
            "+faststart",
        ],
        &clip,
    );
    // The fake camera's frames (Chromium loops the file).
    let y4m = dir.join("camera.y4m");
    ffmpeg(
        &[
            "-f",
            "lavfi",
            "-i",
            "testsrc2=size=320x240:rate=10",
            "-t",
            "2",
            "-pix_fmt",
            "yuv420p",
        ],
        &y4m,
    );
    let video = ServeProcess::start(&["--api-key", "sekret"], 600);
    let text_model = root().join("tests/fixtures/tiny-llama");
    let text = ServeProcess::start(&["--model", text_model.to_str().unwrap()], 120);
    let mut cmd = Command::new("node");
    cmd.arg(root().join("tests/e2e/console.mjs"))
        .current_dir(root())
        .env("CONSOLE_URL", format!("{}/", video.url()))
        .env("CONSOLE_TEXT_URL", format!("{}/", text.url()))
        .env("CONSOLE_API_KEY", "sekret")
        .env("CONSOLE_CLIP", &clip)
        .env("CONSOLE_Y4M", &y4m)
        .env("CHROMIUM", &chromium)
        .env("PLAYWRIGHT_CORE", &playwright);
    if let Some(shot) = std::env::var_os("CONSOLE_SCREENSHOT") {
        cmd.env("CONSOLE_SCREENSHOT", root().join(shot));
    }
    let out = cmd.output().expect("run node");
    let report = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{report}");
    let _ = std::fs::remove_dir_all(&dir);
    let mut video = video;
    assert!(
        out.status.success(),
        "the console test failed:\n{report}\nserver log:\n{}",
        video.drain_log()
    );
    assert!(report.contains("console e2e: passed"), "{report}");
}
