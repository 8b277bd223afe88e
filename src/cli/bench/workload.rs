//! What `caracal bench --url` sends: its settings ([`LoadConfig`], with the soak's
//! [`SoakConfig`]), the random-word prompts, the request [`Shape`] of each endpoint,
//! how an agent-loop conversation grows ([`append_turn`]) and the latency summary
//! ([`Dist`]). Shared by the serving and agent-loop scenarios ([`super::load`]) and
//! the soak ([`super::soak`]).

use std::path::PathBuf;
use std::time::Duration;

use caracal_kernels::sampling::Rng;
use serde::Serialize;
use serde_json::{json, Value};

/// Words prompts are made of.
const WORDS: &[&str] = &[
    "the",
    "time",
    "people",
    "year",
    "way",
    "day",
    "man",
    "thing",
    "woman",
    "life",
    "child",
    "world",
    "school",
    "state",
    "family",
    "student",
    "group",
    "country",
    "problem",
    "hand",
    "part",
    "place",
    "case",
    "week",
    "company",
    "system",
    "program",
    "question",
    "work",
    "government",
    "number",
    "night",
    "point",
    "home",
    "water",
    "room",
    "mother",
    "area",
    "money",
    "story",
    "fact",
    "month",
    "lot",
    "right",
    "study",
    "book",
    "eye",
    "job",
    "word",
    "business",
    "issue",
    "side",
    "kind",
    "head",
    "house",
    "service",
    "friend",
    "father",
    "power",
    "hour",
    "game",
    "line",
    "end",
    "member",
    "law",
    "car",
    "city",
    "name",
    "team",
    "minute",
    "idea",
    "kid",
    "body",
    "information",
    "back",
    "parent",
    "face",
    "others",
    "level",
    "office",
    "door",
    "health",
    "person",
    "art",
    "war",
    "history",
    "party",
    "result",
    "change",
    "morning",
    "reason",
    "research",
    "girl",
    "guy",
    "moment",
    "air",
    "teacher",
    "force",
    "education",
    "good",
    "new",
    "first",
    "last",
    "long",
    "great",
    "little",
    "own",
    "other",
    "old",
    "big",
    "high",
    "different",
    "small",
    "large",
    "next",
    "early",
    "young",
    "important",
    "few",
    "public",
    "bad",
    "same",
    "able",
    "open",
    "green",
    "river",
    "stone",
    "light",
    "music",
    "table",
    "window",
    "garden",
    "paper",
    "market",
    "field",
    "road",
];

/// Which OpenAI endpoint requests go to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Endpoint {
    /// `POST /v1/chat/completions` with `messages`.
    Chat,
    /// `POST /v1/completions` with a text `prompt`.
    Completions,
}

impl Endpoint {
    /// The request path.
    pub(super) fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
        }
    }
}

/// Which load `--url` generates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    /// Independent requests per concurrency level.
    Serving,
    /// Concurrent multi-turn sessions that append tool results.
    AgentLoop,
}

/// Settings of one `--url` run (from the command line).
#[derive(Debug, Clone)]
pub struct LoadConfig {
    /// The server.
    pub url: String,
    /// Bearer key.
    pub api_key: Option<String>,
    /// Model name to send; `None` asks `GET /v1/models`.
    pub model: Option<String>,
    /// Endpoint to call.
    pub endpoint: Endpoint,
    /// Scenario to run.
    pub scenario: Scenario,
    /// Requests per concurrency level (serving).
    pub num_prompts: usize,
    /// Prompt length in words (serving; the first turn of agent-loop).
    pub input_len: usize,
    /// Output tokens per request (`max_tokens`).
    pub output_len: usize,
    /// Concurrency levels (serving).
    pub concurrency: Vec<usize>,
    /// Poisson arrival rate per second; infinite sends all at once.
    pub request_rate: f64,
    /// Concurrent sessions (agent-loop).
    pub sessions: usize,
    /// Turns per session (agent-loop).
    pub turns: usize,
    /// Tool-result length in words (agent-loop).
    pub tool_result_len: usize,
    /// Send `ignore_eos: true` so every answer has `output_len` tokens.
    pub ignore_eos: bool,
    /// Seed of the prompts and arrivals.
    pub seed: u64,
    /// Print JSON instead of tables.
    pub json: bool,
    /// agent-loop: run for a duration, sampling the server (the soak).
    pub soak: Option<SoakConfig>,
}

/// Mean and percentiles of one latency, milliseconds.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Dist {
    /// Arithmetic mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
}

impl Dist {
    /// Of values in seconds, reported in milliseconds (linear interpolation
    /// between order statistics).
    pub(super) fn of_secs(values: impl IntoIterator<Item = f64>) -> Dist {
        let mut v: Vec<f64> = values.into_iter().map(|x| x * 1e3).collect();
        if v.is_empty() {
            return Dist::default();
        }
        v.sort_by(|a, b| a.total_cmp(b));
        let q = |p: f64| {
            let x = (v.len() - 1) as f64 * p;
            let (lo, hi) = (x.floor() as usize, x.ceil() as usize);
            v[lo] + (v[hi] - v[lo]) * (x - lo as f64)
        };
        Dist {
            mean: v.iter().sum::<f64>() / v.len() as f64,
            p50: q(0.5),
            p99: q(0.99),
        }
    }
}

/// `n` random words.
pub(super) fn words(rng: &mut Rng, n: usize) -> String {
    let mut s = String::with_capacity(n * 7);
    for i in 0..n {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(WORDS[(rng.next_u64() % WORDS.len() as u64) as usize]);
    }
    s
}

/// What every request carries besides its prompt.
#[derive(Debug, Clone)]
pub(super) struct Shape {
    /// Endpoint.
    pub(super) endpoint: Endpoint,
    /// Model name.
    pub(super) model: String,
    /// `max_tokens`.
    pub(super) max_tokens: usize,
    /// `ignore_eos`.
    pub(super) ignore_eos: bool,
}

impl Shape {
    /// The request body: `prompt` is the chat `messages` array or a text.
    pub(super) fn body(&self, prompt: Value, max_tokens: usize) -> Value {
        let mut b = json!({
            "model": self.model,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        if self.ignore_eos {
            b["ignore_eos"] = json!(true);
        }
        match self.endpoint {
            Endpoint::Chat => b["messages"] = prompt,
            Endpoint::Completions => b["prompt"] = prompt,
        }
        b
    }

    /// A single user turn of `text`.
    pub(super) fn first(&self, text: String) -> Value {
        match self.endpoint {
            Endpoint::Chat => json!([{"role": "user", "content": text}]),
            Endpoint::Completions => json!(text),
        }
    }
}

/// Appends the model's answer (as an assistant tool call) and a tool result.
pub(super) fn append_turn(
    convo: &mut Value,
    endpoint: Endpoint,
    answer: &str,
    tool: &str,
    id: usize,
    t: usize,
) {
    match endpoint {
        Endpoint::Chat => {
            let call = format!("call_{id}_{t}");
            if let Some(list) = convo.as_array_mut() {
                list.push(json!({
                    "role": "assistant",
                    "content": answer,
                    "tool_calls": [{"id": call, "type": "function",
                                    "function": {"name": "run", "arguments": "{}"}}],
                }));
                list.push(json!({"role": "tool", "tool_call_id": call, "content": tool}));
            }
        }
        Endpoint::Completions => {
            let text = format!("{}{answer}\n{tool}\n", convo.as_str().unwrap_or_default());
            *convo = json!(text);
        }
    }
}

/// The soak's own settings (the rest is the agent-loop's [`LoadConfig`]).
#[derive(Debug, Clone)]
pub struct SoakConfig {
    /// How long the sessions run.
    pub duration: Duration,
    /// Time between rows.
    pub sample_interval: Duration,
    /// CSV of the rows.
    pub csv: Option<PathBuf>,
    /// PNG of RSS, KV pages and TTFT p99 over time.
    pub plot: Option<PathBuf>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate() {
        let d = Dist::of_secs([0.001, 0.002, 0.003, 0.004]);
        assert!((d.mean - 2.5).abs() < 1e-9);
        assert!((d.p50 - 2.5).abs() < 1e-9);
        assert!((d.p99 - 3.97).abs() < 1e-9);
        assert_eq!(Dist::of_secs([]).p99, 0.0);
    }

    #[test]
    fn words_are_seeded_and_counted() {
        let (mut a, mut b) = (Rng::new(3), Rng::new(3));
        let w = words(&mut a, 12);
        assert_eq!(w, words(&mut b, 12));
        assert_eq!(w.split(' ').count(), 12);
    }

    #[test]
    fn agent_turns_grow_the_conversation() {
        let shape = Shape {
            endpoint: Endpoint::Chat,
            model: "m".into(),
            max_tokens: 4,
            ignore_eos: true,
        };
        let mut convo = shape.first("hello".into());
        append_turn(&mut convo, Endpoint::Chat, "answer", "result", 0, 1);
        let list = convo.as_array().expect("messages");
        assert_eq!(list.len(), 3);
        assert_eq!(list[1]["tool_calls"][0]["id"], list[2]["tool_call_id"]);
        let body = shape.body(convo.clone(), 4);
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert_eq!(body["messages"][2]["content"], "result");
        let mut text = json!("p ");
        append_turn(&mut text, Endpoint::Completions, "a", "r", 0, 1);
        assert_eq!(text, "p a\nr\n");
    }
}
