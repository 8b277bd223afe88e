//! The tool-call stream parsers (Kimi K2 sections, Kimi K3 XTML in both
//! starting channels, Hermes `<tool_call>`) fed arbitrary model output cut
//! at arbitrary chunk boundaries: they never panic, and the events (with
//! adjacent deltas merged) are the same whatever the cuts — one piece, any
//! chunking, or one char at a time.
//!
//! The text is built from what trips parsers: each format's control
//! markers, marker prefixes cut anywhere, JSON fragments (quotes,
//! escapes, braces, huge numbers), XTML headers and attributes, tool
//! names, and arbitrary Unicode. Long run: `FUZZ_SECS=600 cargo test
//! --release --test fuzz_toolcall -- --ignored --nocapture`.

mod fuzz_support;

use caracal::chat::toolcall::{
    coalesce, HermesStreamParser, K2StreamParser, K3StreamParser, ParseEvent, StreamParser,
};
use proptest::prelude::*;

// The markers each format's parser recognises, as the parsers themselves list them.
use caracal::chat::toolcall::hermes::HERMES_MARKERS;
use caracal::chat::toolcall::kimi_k2::K2_MARKERS;
use caracal::chat::toolcall::kimi_k3_parser::K3_MARKERS;

/// Pieces of text that parsers treat specially, across the formats.
const FRAGMENTS: &[&str] = &[
    "{",
    "}",
    "[",
    "]",
    "\"",
    "\\",
    "\\\"",
    "\\u00",
    ":",
    ",",
    " ",
    "\n",
    "null",
    "true",
    "-0",
    "1e999999",
    "123456789012345678901234567890",
    "{\"city\": \"Paris\"}",
    "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}",
    "{\"name\": 3, \"arguments\": \"x\"}",
    "\"arguments\"",
    "\"name\"",
    "functions.get_weather:0",
    "functions.:1",
    "get_weather",
    "message role=\"assistant\"",
    "think",
    "response",
    "tools",
    "call name=\"get_weather\"",
    "call",
    "argument name=\"city\" type=\"string\"",
    "argument name=\"n\" type=\"integer\"",
    "argument",
    "json",
    "name=\"",
    "&quot;",
    "&amp;",
    "<|",
    "|>",
    "<",
    ">",
    "</",
    "é",
    "🦙",
    "\u{0}",
];

/// Model output for a format with `markers`: markers, their prefixes,
/// fragments and arbitrary text, concatenated.
fn output(markers: &'static [&'static str]) -> impl Strategy<Value = String> {
    let prefix = (prop::sample::select(markers.to_vec()), 1usize..40).prop_map(|(m, k)| {
        let k = k.min(m.len() - 1);
        m[..k].to_string()
    });
    let atom = prop_oneof![
        4 => prop::sample::select(markers.to_vec()).prop_map(String::from),
        4 => prop::sample::select(FRAGMENTS.to_vec()).prop_map(String::from),
        1 => prefix,
        2 => "\\PC{0,8}",
        1 => any::<String>().prop_map(|s| s.chars().take(8).collect()),
    ];
    prop::collection::vec(atom, 0..40).prop_map(|v| v.concat())
}

/// Chunk sizes in chars (the rest goes in one last piece).
fn cuts() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(1usize..12, 0..48)
}

/// Feeds `text` cut after the given char counts and merges the events.
fn parse_cut(mut parser: impl StreamParser, text: &str, sizes: &[usize]) -> Vec<ParseEvent> {
    let chars: Vec<char> = text.chars().collect();
    let mut events = Vec::new();
    let mut at = 0;
    for &size in sizes {
        if at >= chars.len() {
            break;
        }
        let end = (at + size).min(chars.len());
        events.extend(parser.push(&chars[at..end].iter().collect::<String>()));
        at = end;
    }
    if at < chars.len() {
        events.extend(parser.push(&chars[at..].iter().collect::<String>()));
    }
    events.extend(parser.finish());
    coalesce(events)
}

/// The split-invariance property of one parser on one input.
fn same_for_any_cut<P: StreamParser>(
    new: impl Fn() -> P,
    text: &str,
    sizes: &[usize],
) -> Result<(), TestCaseError> {
    let whole = parse_cut(new(), text, &[]);
    let cut = parse_cut(new(), text, sizes);
    prop_assert_eq!(&cut, &whole, "cut at {:?}", sizes);
    let by_char = parse_cut(new(), text, &vec![1; text.chars().count()]);
    prop_assert_eq!(&by_char, &whole, "one char at a time");
    // Tool-call events name calls that started, in order.
    let mut started = 0usize;
    for ev in &whole {
        match ev {
            ParseEvent::ToolCallStart { index, .. } => {
                prop_assert_eq!(*index, started, "call indices count up");
                started += 1;
            }
            ParseEvent::ToolCallArgs { index, .. } | ParseEvent::ToolCallEnd { index } => {
                prop_assert!(
                    *index < started,
                    "event for call {} before it started",
                    index
                );
            }
            _ => {}
        }
    }
    Ok(())
}

fn k2(text: &str, sizes: &[usize]) -> Result<(), TestCaseError> {
    same_for_any_cut(K2StreamParser::new, text, sizes)
}

fn k3(text: &str, sizes: &[usize], thinking: bool) -> Result<(), TestCaseError> {
    same_for_any_cut(|| K3StreamParser::new(thinking), text, sizes)
}

fn hermes(text: &str, sizes: &[usize]) -> Result<(), TestCaseError> {
    same_for_any_cut(HermesStreamParser::new, text, sizes)
}

proptest! {
    #![proptest_config(fuzz_support::config(1000))]

    #[test]
    fn k2_parser_is_split_invariant_and_never_panics(text in output(K2_MARKERS), sizes in cuts()) {
        k2(&text, &sizes)?;
    }

    #[test]
    fn k3_parser_is_split_invariant_and_never_panics(
        text in output(K3_MARKERS), sizes in cuts(), thinking in any::<bool>()
    ) {
        k3(&text, &sizes, thinking)?;
    }

    #[test]
    fn hermes_parser_is_split_invariant_and_never_panics(text in output(HERMES_MARKERS), sizes in cuts()) {
        hermes(&text, &sizes)?;
    }

    #[test]
    fn every_parser_survives_every_other_format(
        text in output(&["<|tool_calls_section_begin|>", "<|open|>", "<|close|>", "<|sep|>", "<tool_call>", "</tool_call>", "<think>", "</think>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"]),
        sizes in cuts(),
    ) {
        k2(&text, &sizes)?;
        k3(&text, &sizes, true)?;
        hermes(&text, &sizes)?;
    }
}

// Findings, kept as named regressions.

/// Found by `hermes_parser_is_split_invariant_and_never_panics`: an empty
/// (malformed) `<tool_call></tool_call>` took call index 0, so the valid
/// call after it streamed as `tool_calls[1]` with no `[0]`.
#[test]
fn hermes_malformed_block_takes_no_call_index() {
    let text = "<tool_call></tool_call><tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}";
    let events = parse_cut(HermesStreamParser::new(), text, &[]);
    assert!(
        matches!(events[0], ParseEvent::Malformed { index: None, .. }),
        "{events:?}"
    );
    assert!(
        matches!(&events[1], ParseEvent::ToolCallStart { index: 0, name, .. } if name == "get_weather"),
        "{events:?}"
    );
    hermes(text, &[3, 5, 7]).expect("split invariant");
}

#[test]
#[ignore = "long run: FUZZ_SECS=600 cargo test --release --test fuzz_toolcall -- --ignored"]
fn soak_toolcall_parsers() {
    let any_format = prop_oneof![
        output(K2_MARKERS).prop_map(|t| (0u8, t)),
        output(K3_MARKERS).prop_map(|t| (1u8, t)),
        output(K3_MARKERS).prop_map(|t| (2u8, t)),
        output(HERMES_MARKERS).prop_map(|t| (3u8, t)),
    ];
    fuzz_support::soak(
        "tool-call parsers",
        (any_format, cuts()),
        |((format, t), s)| match format {
            0 => k2(&t, &s),
            1 => k3(&t, &s, true),
            2 => k3(&t, &s, false),
            _ => hermes(&t, &s),
        },
    );
}
