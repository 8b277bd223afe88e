//! Slow readers: clients that stop reading stall their own streams on
//! credit (nothing buffers without bound) while others are served.

use super::wire::{self, Sse};
use crate::{normal_answer, normal_ws_turn, storm, Storm};
use serde_json::json;
use std::time::{Duration, Instant};

#[test]
fn slow_readers_stall_their_own_streams_and_others_are_served() {
    storm(600, || async {
        let mut s = Storm::start(&["--max-running-requests", "16"]).await;
        let addr = s.addr;
        let before = wire::metrics(addr).await;
        // Clients that read the head (or the upgrade) and then nothing, on
        // small receive buffers; log-probabilities make every token's frame
        // large, so the socket buffers fill in a few hundred tokens.
        const SSE_READERS: usize = 3;
        const WS_READERS: usize = 1;
        let mut held = Vec::new();
        for i in 0..SSE_READERS {
            let stream = wire::connect(addr, Some(4096)).await.expect("connect");
            let body = json!({"messages": [{"role": "user", "content": format!("Slow reader {i}")}],
                              "max_tokens": 6000, "ignore_eos": true, "stream": true,
                              "logprobs": true, "top_logprobs": 20});
            let sse = Sse::open_on(stream, "/v1/chat/completions", &body)
                .await
                .expect("send")
                .expect("the stream opens");
            held.push(sse);
        }
        let mut sockets = Vec::new();
        for i in 0..WS_READERS {
            let mut ws = wire::ws_small_buffer(addr, "/v1/responses", 4096)
                .await
                .expect("upgrade");
            let create = json!({"type": "response.create", "input": format!("Slow socket {i}"),
                                "max_output_tokens": 6000, "ignore_eos": true, "store": false,
                                "top_logprobs": 20, "include": ["message.output_text.logprobs"]});
            wire::ws_send(&mut ws, &create).await.expect("send");
            sockets.push(ws);
        }
        // The stall: every slow stream's credit runs out and the scheduler
        // stops stepping for them (nothing buffers without bound).
        let deadline = Instant::now() + Duration::from_secs(300);
        let mut prev = -1.0;
        let stalled = loop {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            let m = wire::metrics(addr).await;
            let steps = m["caracal_forward_steps_total"];
            if steps == prev && m["caracal_running_sequences"] == (SSE_READERS + WS_READERS) as f64
            {
                break m;
            }
            prev = steps;
            assert!(
                Instant::now() < deadline,
                "the server kept decoding for clients that read nothing ({steps} steps): unbounded buffering"
            );
        };
        let stalls = stalled["caracal_credit_stalls_total"] - before["caracal_credit_stalls_total"];
        assert!(stalls > 0.0, "the slow readers' streams stalled on credit");
        let rss_stalled = s.server.status_kib("VmRSS");
        let tokens_per_stream = (stalled["caracal_forward_steps_total"]
            - before["caracal_forward_steps_total"]) as usize;
        // Others are served meanwhile (the slow streams keep their slots).
        for _ in 0..3 {
            assert_eq!(
                normal_answer(addr).await,
                s.reference,
                "a normal client is served"
            );
        }
        normal_ws_turn(addr).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let later = wire::metrics(addr).await;
        assert_eq!(
            later["caracal_running_sequences"],
            (SSE_READERS + WS_READERS) as f64,
            "the slow streams are still open, paused"
        );
        let rss_later = s.server.status_kib("VmRSS");
        eprintln!(
            "slow readers: {SSE_READERS} SSE + {WS_READERS} WebSocket stalled after {tokens_per_stream} steps, \
             {stalls} credit stalls; RSS {rss_stalled} KiB stalled, {rss_later} KiB after 3 more requests"
        );
        drop(held);
        drop(sockets);
        s.settle("slow readers").await;
    });
}
