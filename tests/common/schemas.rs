//! Random tool declarations for the constrained-decoding stress tests
//! (`tests/constrain.rs` samples from the mask; `tests/constrain_model.rs`
//! decodes with real models through the gateway).
//!
//! [`draw_spec`] draws one to three tools whose `parameters` are random
//! object schemas: nested objects to depth 3, arrays with item bounds,
//! enums, integer and number ranges, strings with `maxLength` and
//! `pattern`, required and optional keys, `anyOf`; every object closes
//! with `additionalProperties: false`. Every value has a bounded spelling
//! except JSON numbers, whose fraction digits no schema keyword bounds;
//! [`Draw::finite_numbers`] adds a power-of-two `multipleOf` so that a
//! model that never chooses to end a number still must (and keeps those
//! ranges non-negative, see [`value_schema`]).
//!
//! Also [`check_calls`], the independent check (the `jsonschema` crate) of
//! parsed calls against what a spec allows, and [`openai_tools`], a spec
//! in the request shape.

use serde_json::{json, Map, Value};

use caracal::constrain::{ToolChoice, ToolDecl, ToolFormat, ToolsSpec};

/// SplitMix64: a small seeded generator, so every run draws the same cases.
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: i64, hi: i64) -> i64 {
        lo + (self.next() % (hi - lo + 1) as u64) as i64
    }
    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        ((self.next() >> 11) as f64 / (1u64 << 53) as f64) < p
    }
}

/// What a draw may contain.
#[derive(Debug, Clone, Copy)]
pub struct Draw {
    /// Draw `tool_choice: "auto"` for a fifth of the cases (else only
    /// `required` and named tools).
    pub auto: bool,
    /// Numbers carry `multipleOf` 1/2, 1/4 or 1/8 (exact in binary, so
    /// validators agree), bounding their fraction digits.
    pub finite_numbers: bool,
}

const PATTERNS: [(&str, u64); 6] = [
    ("^[a-z]{1,8}$", 8),
    ("^[A-Z][a-z0-9]{0,6}$", 7),
    ("^[0-9]{3}-[0-9]{2}$", 6),
    ("^(red|green|blue)$", 5),
    ("^[a-z_]+$", 10),
    ("^v[0-9]+\\.[0-9]+$", 9),
];

const WORDS: [&str; 12] = [
    "city", "query", "limit", "mode", "tags", "owner", "filter", "range", "label", "when", "score",
    "items",
];

/// A random schema for a value at object depth `depth` (1 = inside the arguments).
fn value_schema(rng: &mut Rng, draw: Draw, depth: usize) -> Value {
    let pick = rng.below(if depth < 3 { 10 } else { 8 });
    match pick {
        0 | 1 => {
            let mut s = json!({"type": "string", "maxLength": rng.range(1, 16)});
            if rng.chance(0.4) {
                let (p, max) = PATTERNS[rng.below(PATTERNS.len())];
                s = json!({"type": "string", "pattern": p, "maxLength": max});
            } else if rng.chance(0.3) {
                s["minLength"] = json!(1);
            }
            s
        }
        2 => {
            let lo = rng.range(-1000, 1000);
            let mut s =
                json!({"type": "integer", "minimum": lo, "maximum": lo + rng.range(0, 5000)});
            if rng.chance(0.3) {
                s = json!({"type": "integer", "exclusiveMinimum": lo, "exclusiveMaximum": lo + rng.range(2, 50)});
            }
            s
        }
        3 => {
            let mut lo = rng.range(-100, 100) as f64 / 4.0;
            if draw.finite_numbers {
                // The `jsonschema` crate (0.33) finds no negative number a
                // multiple of a fractional `multipleOf` (-3.5 of 0.5, say):
                // these ranges start at 0.
                lo = lo.abs();
            }
            let width = rng.range(1, 400) as f64 / 8.0;
            let mut s = json!({"type": "number", "minimum": lo, "maximum": lo + width});
            if draw.finite_numbers {
                // At least one step wide, so that the range holds a multiple.
                let step = [0.5, 0.25, 0.125][rng.below(3)];
                s["maximum"] = json!(lo + width.max(step));
                s["multipleOf"] = json!(step);
            }
            s
        }
        4 => json!({"type": "boolean"}),
        5 => {
            let mut values: Vec<Value> = (0..rng.range(1, 4))
                .map(|i| json!(format!("{}_{i}", WORDS[rng.below(WORDS.len())])))
                .collect();
            if rng.chance(0.3) {
                values.push(json!(rng.range(0, 9)));
            }
            json!({"enum": values})
        }
        6 => {
            json!({"anyOf": [value_schema(rng, draw, 3), value_schema(rng, draw, 3), {"type": "null"}]})
        }
        7 => {
            let min = rng.range(0, 2);
            json!({"type": "array", "items": value_schema(rng, draw, 3), "minItems": min, "maxItems": min + rng.range(0, 3)})
        }
        8 => {
            let min = rng.range(0, 1);
            json!({"type": "array", "items": object_schema(rng, draw, depth + 1), "minItems": min, "maxItems": min + rng.range(0, 2)})
        }
        _ => object_schema(rng, draw, depth + 1),
    }
}

/// A random object schema at `depth` (nesting stops at 3).
fn object_schema(rng: &mut Rng, draw: Draw, depth: usize) -> Value {
    let n = rng.range(1, if depth == 1 { 5 } else { 3 }) as usize;
    let mut props = Map::new();
    let mut required = Vec::new();
    for i in 0..n {
        let key = format!("{}{i}", WORDS[rng.below(WORDS.len())]);
        if rng.chance(0.6) {
            required.push(json!(key));
        }
        props.insert(key, value_schema(rng, draw, depth));
    }
    json!({"type": "object", "properties": props, "required": required, "additionalProperties": false})
}

const NAMES: [&str; 8] = [
    "get_weather",
    "search_docs",
    "create_ticket",
    "send_mail",
    "list_files",
    "book_table",
    "convert_units",
    "lookup_user",
];

/// One case: the tools, the choice (`required` 6 in 10, a named tool 2 in
/// 10, `auto` or `required` the rest), parallelism (half the cases).
pub fn draw_spec(rng: &mut Rng, format: ToolFormat, draw: Draw) -> ToolsSpec {
    let tools: Vec<ToolDecl> = (0..rng.range(1, 3))
        .map(|i| ToolDecl {
            name: format!("{}_{i}", NAMES[rng.below(NAMES.len())]),
            parameters: object_schema(rng, draw, 1),
        })
        .collect();
    let choice = match rng.below(10) {
        0..=5 => ToolChoice::Required,
        6 | 7 => ToolChoice::Named(tools[rng.below(tools.len())].name.clone()),
        _ if draw.auto => ToolChoice::Auto,
        _ => ToolChoice::Required,
    };
    ToolsSpec {
        tools,
        choice,
        parallel: rng.chance(0.5),
        format,
    }
}

/// `spec`'s `tools`, `tool_choice` and `parallel_tool_calls` as request fields.
pub fn openai_tools(spec: &ToolsSpec) -> Value {
    let tools: Vec<Value> = spec
        .tools
        .iter()
        .map(|t| json!({"type": "function", "function": {"name": t.name, "parameters": t.parameters}}))
        .collect();
    let choice = match &spec.choice {
        ToolChoice::Auto => json!("auto"),
        ToolChoice::None => json!("none"),
        ToolChoice::Required => json!("required"),
        ToolChoice::Named(n) => json!({"type": "function", "function": {"name": n}}),
    };
    json!({"tools": tools, "tool_choice": choice, "parallel_tool_calls": spec.parallel})
}

/// Whether `calls` are well-formed calls of `spec`: at least one, one
/// unless `parallel_tool_calls`, only callable names, and arguments that
/// the `jsonschema` crate finds valid under their tool's schema.
pub fn check_calls(spec: &ToolsSpec, calls: &[(String, Value)]) -> Result<(), String> {
    if calls.is_empty() {
        return Err("no call".into());
    }
    if !spec.parallel && calls.len() > 1 {
        return Err(format!("{} calls without parallel_tool_calls", calls.len()));
    }
    for (name, args) in calls {
        let tool = spec
            .callable()
            .into_iter()
            .find(|t| &t.name == name)
            .ok_or_else(|| format!("undeclared tool {name}"))?;
        let validator = jsonschema::validator_for(&tool.parameters).map_err(|e| e.to_string())?;
        let first_error = validator.iter_errors(args).next().map(|e| e.to_string());
        if let Some(e) = first_error {
            return Err(format!("{name}({args}) breaks its schema: {e}"));
        }
    }
    Ok(())
}
