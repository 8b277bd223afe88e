//! The real `caracal serve` binary as a child process on a free loopback
//! port, for tests that drive it with outside clients (the `openai` SDK,
//! Codex, `caracal bench --url`). Killed when dropped.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A free TCP port on 127.0.0.1.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A running `caracal serve`, its stderr collected line by line.
pub struct ServeProcess {
    /// The process.
    pub child: Child,
    /// The port it listens on.
    pub port: u16,
    /// Stderr lines not yet moved into `log`.
    lines: mpsc::Receiver<String>,
    /// Stderr lines seen so far.
    pub log: Vec<String>,
}

impl ServeProcess {
    /// Starts `caracal serve --port P <args>` and waits (up to `secs`) for
    /// its startup line; panics with the log when it does not come.
    pub fn start(args: &[&str], secs: u64) -> ServeProcess {
        let port = free_port();
        let mut child = Command::new(env!("CARGO_BIN_EXE_caracal"))
            .args(["serve", "--port", &port.to_string()])
            .args(args)
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
        let mut server = ServeProcess {
            child,
            port,
            lines,
            log: Vec::new(),
        };
        assert!(
            server.wait_for("caracal serve: model", secs),
            "the server did not start:\n{}",
            server.log.join("\n")
        );
        server
    }

    /// A memory line of the server's `/proc/PID/status` in KiB: `VmRSS` (all
    /// resident memory), `RssAnon` (heap and stacks: what the server allocated) or
    /// `RssFile` (resident pages of mapped files: the binary and the checkpoint's
    /// mapped tensors); 0 when it cannot be read.
    pub fn status_kib(&self, field: &str) -> u64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            })
            .unwrap_or(0)
    }

    /// Runs `caracal bench --url <this server> --json <args>`, asserts it
    /// succeeded and returns its JSON report.
    pub fn bench(&self, args: &[&str]) -> serde_json::Value {
        let out = Command::new(env!("CARGO_BIN_EXE_caracal"))
            .args(["bench", "--url", &self.url(), "--json"])
            .args(args)
            .output()
            .expect("run caracal bench");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "bench failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Waits (up to `secs`) for a stderr line containing `needle`.
    pub fn wait_for(&mut self, needle: &str, secs: u64) -> bool {
        let deadline = Instant::now() + Duration::from_secs(secs);
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
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

    /// Everything the server has logged so far.
    pub fn drain_log(&mut self) -> String {
        while let Ok(line) = self.lines.try_recv() {
            self.log.push(line);
        }
        self.log.join("\n")
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
