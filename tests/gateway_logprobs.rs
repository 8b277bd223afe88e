//! Log-probabilities over real sockets with the tiny-llama checkpoint:
//! Chat Completions (JSON and SSE), Completions and Responses report one
//! entry per generated token, and the values equal a log-softmax of the
//! model's own logits computed in-process.

mod common;
mod gateway_support;

use caracal::generate::{prompt_logits, LoadedModel};
use gateway_support::*;
use serde_json::{json, Value};

/// Entries of a chat answer's `logprobs.content`.
fn entries(v: &Value) -> Vec<Value> {
    v["content"].as_array().cloned().unwrap_or_default()
}

/// Each entry's alternatives are sorted and the greedy token is the first.
fn check_greedy_entries(list: &[Value], top: usize) {
    for e in list {
        let alts = e["top_logprobs"].as_array().unwrap();
        assert_eq!(alts.len(), top, "{e}");
        let values: Vec<f64> = alts
            .iter()
            .map(|a| a["logprob"].as_f64().unwrap())
            .collect();
        assert!(values.windows(2).all(|w| w[0] >= w[1]), "{e}");
        assert!(values.iter().all(|&l| l <= 0.0), "{e}");
        // Greedy with no penalties samples the argmax of the raw logits.
        assert_eq!(alts[0]["token"], e["token"], "{e}");
        assert!(
            (alts[0]["logprob"].as_f64().unwrap() - e["logprob"].as_f64().unwrap()).abs() < 1e-6
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_reports_one_entry_per_token_streamed_or_not() {
    let server = start_llama().await;
    let body = json!({"model": "tiny-llama", "messages": [{"role": "user", "content": "Hello there"}],
                      "max_tokens": 10, "temperature": 0, "ignore_eos": true,
                      "logprobs": true, "top_logprobs": 3});
    let (status, full) = json(server.addr, "POST", "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{full}");
    let choice = &full["choices"][0];
    let list = entries(&choice["logprobs"]);
    assert_eq!(list.len(), 10, "{full}");
    check_greedy_entries(&list, 3);
    let bytes: Vec<u8> = list
        .iter()
        .flat_map(|e| {
            e["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8)
        })
        .collect();
    assert_eq!(
        String::from_utf8_lossy(&bytes),
        choice["message"]["content"].as_str().unwrap(),
        "the tokens' bytes spell the answer"
    );

    let mut streamed_body = body.clone();
    streamed_body["stream"] = json!(true);
    let events = sse(server.addr, "/v1/chat/completions", &streamed_body).await;
    let streamed: Vec<Value> = events
        .iter()
        .flat_map(|e| entries(&e["choices"][0]["logprobs"]))
        .collect();
    assert_eq!(streamed.len(), list.len());
    for (s, j) in streamed.iter().zip(&list) {
        assert_eq!(s["token"], j["token"], "the stream carries the same tokens");
        // Tolerance: the second run's prompt comes from the prefix cache,
        // whose attention sums in another order.
        let d = (s["logprob"].as_f64().unwrap() - j["logprob"].as_f64().unwrap()).abs();
        assert!(d < 1e-4, "{s} vs {j}");
    }

    // Without the flag there are none; `top_logprobs` alone is refused.
    let mut plain = body.clone();
    plain.as_object_mut().unwrap().remove("logprobs");
    plain.as_object_mut().unwrap().remove("top_logprobs");
    let (_, v) = json(server.addr, "POST", "/v1/chat/completions", &plain).await;
    assert_eq!(v["choices"][0]["logprobs"], Value::Null);
    plain["top_logprobs"] = json!(2);
    let (status, err) = json(server.addr, "POST", "/v1/chat/completions", &plain).await;
    assert_eq!(status, 400);
    assert_eq!(err["error"]["param"], "top_logprobs");
    plain["logprobs"] = json!(true);
    plain["top_logprobs"] = json!(21);
    let (status, _) = json(server.addr, "POST", "/v1/chat/completions", &plain).await;
    assert_eq!(status, 400);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_logprobs_equal_a_log_softmax_of_the_models_logits() {
    let server = start_llama().await;
    let prompt: Vec<u32> = vec![1, 17, 42, 99, 7, 250];
    let body = json!({"model": "tiny-llama", "prompt": prompt, "max_tokens": 4,
                      "temperature": 0, "ignore_eos": true, "logprobs": 2});
    let (status, v) = json(server.addr, "POST", "/v1/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    let tokens = lp["tokens"].as_array().unwrap();
    let values = lp["token_logprobs"].as_array().unwrap();
    let offsets: Vec<u64> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_u64().unwrap())
        .collect();
    assert_eq!(tokens.len(), 4, "{v}");
    assert_eq!(values.len(), 4);
    assert_eq!(offsets[0], 0);
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]));
    assert!(lp["top_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .all(|t| t.as_object().unwrap().len() <= 2));

    // Reference: the first generated token's log-probability from the
    // model's logits for the prompt, log-softmax in f64.
    let m = LoadedModel::load(&fixture("tiny-llama")).unwrap();
    let logits = prompt_logits(m.model.as_ref(), &prompt).unwrap();
    let vocab = m.model.info().vocab_size;
    let last = &logits[logits.len() - vocab..];
    let max = last.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max
        + last
            .iter()
            .map(|&l| (l as f64 - max).exp())
            .sum::<f64>()
            .ln();
    let argmax = (0..vocab)
        .max_by(|&a, &b| last[a].total_cmp(&last[b]).then(b.cmp(&a)))
        .unwrap();
    let want = last[argmax] as f64 - lse;
    let got = values[0].as_f64().unwrap();
    // Tolerance: f32 log-softmax against f64 over a 2k-entry vocabulary.
    assert!((got - want).abs() < 1e-4, "got {got}, reference {want}");
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_carry_logprobs_in_text_deltas_and_the_output_part() {
    let server = start_llama().await;
    let body = json!({"model": "tiny-llama", "input": "Hello there", "max_output_tokens": 8,
                      "temperature": 0, "include": ["message.output_text.logprobs"],
                      "top_logprobs": 2, "stream": true});
    let events = sse(server.addr, "/v1/responses", &body).await;
    let deltas: Vec<Value> = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .flat_map(|e| e["logprobs"].as_array().cloned().unwrap_or_default())
        .collect();
    let done = events
        .iter()
        .find(|e| e["type"] == "response.output_text.done")
        .expect("a text item");
    assert!(!deltas.is_empty());
    assert_eq!(&Value::Array(deltas.clone()), &done["logprobs"]);
    check_greedy_entries(&deltas, 2);
    // Eight tokens end it by length: `response.incomplete`.
    let completed = events
        .iter()
        .find(|e| e["type"] == "response.completed" || e["type"] == "response.incomplete")
        .expect("a terminal event");
    assert_eq!(completed["response"]["top_logprobs"], 2);
    server.shutdown().await.unwrap();
}
