//! Kimi K3 call arguments as XTML elements, from a tool's `parameters`.
//!
//! A plain object schema (`properties`, `required`, no combinators at the
//! top) becomes one `argument key="k" type="t"` element per property, in
//! declaration order, required ones always present, no undeclared keys.
//! The element's value follows the property's schema per XTML type:
//!
//! - `string`: the raw text (K3 writes strings unquoted), as a terminal
//!   intersecting `minLength`/`maxLength`, the `pattern` (matched whole,
//!   which implies the schema's search semantics) and "no XTML marker";
//! - every other type: `%json` of the schema narrowed to that type, laid
//!   out as Python's `json.dumps` (what K3 renders), with the document's
//!   `$defs` carried along, its strings unable to spell `<|`
//!   ([`crate::constrain::lark::guard_json_strings`]: the parser finds
//!   markers as text, even inside JSON).
//!
//! `anyOf`/`oneOf` properties offer each branch's types; `enum`/`const`
//! their values. Anything this cannot express faithfully (a `format`, a
//! pattern the regex engine rejects, `allOf`, references outside
//! `$defs`) makes the whole call one `json type="object"` element holding
//! the arguments as JSON, which the K3 parser also reads.

use serde_json::{Map, Value};

use super::kimi_k3::{Xtml, K3_MARKER_TEXTS};
use crate::chat::toolcall::kimi_k3::escape_attr;
use crate::constrain::lark::{
    guard_json_strings, json_rule, regex_escape, JsonLayout, NO_PIPE_MARKER,
};
use crate::constrain::schema::resolve_ref;
use crate::constrain::CompileError;

/// Keywords that only annotate (they never restrict values).
const ANNOTATIONS: [&str; 12] = [
    "title",
    "description",
    "default",
    "examples",
    "$comment",
    "$schema",
    "$id",
    "$defs",
    "definitions",
    "readOnly",
    "writeOnly",
    "deprecated",
];

/// JSON types and the XTML `type` attribute each is written with.
const TYPES: [(&str, &str); 7] = [
    ("string", "string"),
    ("integer", "number"),
    ("number", "number"),
    ("boolean", "boolean"),
    ("null", "null"),
    ("object", "object"),
    ("array", "array"),
];

/// One way an argument's value can be written.
#[derive(Debug, Clone)]
enum Variant {
    /// Raw text matching this Lark terminal expression.
    Raw(String),
    /// JSON of this XTML type under this schema.
    Json(&'static str, Value),
}

/// How deep `$ref` chains are followed.
const MAX_REF_DEPTH: usize = 16;

/// Appends the rule `args_{i}` for `params`; false if the call takes no
/// argument elements (an object schema without properties).
pub(crate) fn args_rules(
    out: &mut String,
    i: usize,
    params: &Value,
    x: &Xtml,
) -> Result<bool, CompileError> {
    match element_form(params) {
        Some(props) if props.is_empty() => Ok(false),
        Some(props) => {
            let mut seq = Vec::with_capacity(props.len());
            for (j, (key, variants, required)) in props.iter().enumerate() {
                let mut alts = Vec::with_capacity(variants.len());
                for (n, v) in variants.iter().enumerate() {
                    let (ty, value) = match v {
                        Variant::Raw(expr) => {
                            out.push_str(&format!("R{i}_{j}_{n}: {expr}\n"));
                            ("string", format!("R{i}_{j}_{n}"))
                        }
                        Variant::Json(ty, schema) => {
                            out.push_str(&format!(
                                "j{i}_{j}_{n}: {}\n",
                                json_rule(
                                    &guard_json_strings(&with_defs(params, schema), NO_PIPE_MARKER),
                                    JsonLayout::Python
                                )
                            ));
                            (*ty, format!("j{i}_{j}_{n}"))
                        }
                    };
                    let header = format!("argument key=\"{}\" type=\"{ty}\"", escape_attr(key));
                    alts.push(format!(
                        "{} {value} {}",
                        x.open_tag(&header),
                        x.close_tag("argument")
                    ));
                }
                out.push_str(&format!("a{i}_{j}: {}\n", alts.join(" | ")));
                seq.push(if *required {
                    format!("a{i}_{j}")
                } else {
                    format!("a{i}_{j}?")
                });
            }
            out.push_str(&format!("args_{i}: {}\n", seq.join(" ")));
            Ok(true)
        }
        None => {
            out.push_str(&format!(
                "args_{i}: {} {} {}\n",
                x.open_tag("json type=\"object\""),
                json_rule(
                    &guard_json_strings(params, NO_PIPE_MARKER),
                    JsonLayout::Compact
                ),
                x.close_tag("json")
            ));
            Ok(true)
        }
    }
}

/// The properties of a plain object schema with each one's variants and
/// whether it is required; `None` when the schema needs the `json` element.
fn element_form(params: &Value) -> Option<Vec<(String, Vec<Variant>, bool)>> {
    let obj = params.as_object()?;
    let allowed = ["type", "properties", "required", "additionalProperties"];
    if obj
        .keys()
        .any(|k| !allowed.contains(&k.as_str()) && !is_annotation(k))
    {
        return None;
    }
    if obj.get("type").is_some_and(|t| t != "object") {
        return None;
    }
    let empty = Map::new();
    let props = match obj.get("properties") {
        None => &empty,
        Some(p) => p.as_object()?,
    };
    let required: Vec<&str> = match obj.get("required") {
        None => Vec::new(),
        Some(r) => r
            .as_array()?
            .iter()
            .map(Value::as_str)
            .collect::<Option<_>>()?,
    };
    if required.iter().any(|r| !props.contains_key(*r)) {
        return None;
    }
    props
        .iter()
        .map(|(k, s)| {
            if K3_MARKER_TEXTS.iter().any(|m| k.contains(m)) {
                return None;
            }
            let vs = variants(params, s, 0)?;
            if vs.is_empty() {
                return None;
            }
            Some((k.clone(), merge(vs), required.contains(&k.as_str())))
        })
        .collect()
}

fn is_annotation(k: &str) -> bool {
    ANNOTATIONS.contains(&k) || k.starts_with("x-")
}

/// The ways a value under `s` can be written; `None` if not expressible.
fn variants(root: &Value, s: &Value, depth: usize) -> Option<Vec<Variant>> {
    if depth > MAX_REF_DEPTH {
        return None;
    }
    let obj = match s {
        Value::Bool(true) => &Map::new(),
        Value::Bool(false) => return Some(Vec::new()),
        Value::Object(o) => o,
        _ => return None,
    };
    let validating: Vec<&str> = obj
        .keys()
        .map(String::as_str)
        .filter(|k| !is_annotation(k))
        .collect();
    if let Some(r) = obj.get("$ref") {
        if validating.len() > 1 {
            return None;
        }
        return variants(root, resolve_ref(root, r.as_str()?)?, depth + 1);
    }
    if let Some(v) = obj.get("const") {
        if validating.len() > 1 {
            return None;
        }
        return Some(vec![value_variant(std::slice::from_ref(v))?]);
    }
    if let Some(Value::Array(values)) = obj.get("enum") {
        let others = validating.iter().filter(|k| **k != "enum" && **k != "type");
        if others.count() > 0 {
            return None;
        }
        let strings: Vec<Value> = values.iter().filter(|v| v.is_string()).cloned().collect();
        let mut out = Vec::new();
        if !strings.is_empty() {
            out.push(value_variant(&strings)?);
        }
        for (_, xtml) in TYPES
            .iter()
            .filter(|(t, _)| *t != "string" && *t != "integer")
        {
            let group: Vec<Value> = values
                .iter()
                .filter(|v| !v.is_string() && xtml_type(v) == *xtml)
                .cloned()
                .collect();
            if !group.is_empty() {
                out.push(value_variant(&group)?);
            }
        }
        return Some(out);
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(branches) = obj.get(key) {
            if validating.len() > 1 {
                return None;
            }
            let mut out = Vec::new();
            for b in branches.as_array()? {
                out.extend(variants(root, b, depth + 1)?);
            }
            return Some(out);
        }
    }
    if validating
        .iter()
        .any(|k| matches!(*k, "allOf" | "enum" | "format"))
    {
        return None;
    }
    let types: Vec<&str> = match obj.get("type") {
        None => TYPES.iter().map(|(t, _)| *t).collect(),
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(ts)) => ts.iter().map(Value::as_str).collect::<Option<_>>()?,
        Some(_) => return None,
    };
    let mut out = Vec::new();
    for t in types {
        let (_, xtml) = TYPES.iter().find(|(name, _)| *name == t)?;
        if t == "string" {
            out.push(Variant::Raw(string_terminal(obj)?));
        } else {
            let mut narrowed = obj.clone();
            narrowed.insert("type".into(), Value::String(t.into()));
            let narrowed = Value::Object(narrowed);
            if !refs_stay_in_defs(&narrowed) {
                return None;
            }
            out.push(Variant::Json(xtml, narrowed));
        }
    }
    Some(out)
}

/// Merges variants of one XTML type into one (raw alternatives into one
/// terminal, JSON ones into an `anyOf`), so no two alternatives share a header.
fn merge(vs: Vec<Variant>) -> Vec<Variant> {
    let mut raws: Vec<String> = Vec::new();
    let mut jsons: Vec<(&'static str, Vec<Value>)> = Vec::new();
    for v in vs {
        match v {
            Variant::Raw(e) => raws.push(e),
            Variant::Json(ty, s) => match jsons.iter_mut().find(|(t, _)| *t == ty) {
                Some((_, list)) => list.push(s),
                None => jsons.push((ty, vec![s])),
            },
        }
    }
    let mut out = Vec::new();
    if !raws.is_empty() {
        out.push(Variant::Raw(
            raws.iter()
                .map(|e| format!("({e})"))
                .collect::<Vec<_>>()
                .join(" | "),
        ));
    }
    for (ty, mut list) in jsons {
        let schema = if list.len() == 1 {
            list.remove(0)
        } else {
            serde_json::json!({ "anyOf": list })
        };
        out.push(Variant::Json(ty, schema));
    }
    out
}

/// The XTML type of a JSON value.
fn xtml_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// A variant for a list of literal values of one XTML type.
fn value_variant(values: &[Value]) -> Option<Variant> {
    let first = values.first()?;
    if first.is_string() {
        let mut alts = Vec::with_capacity(values.len());
        for v in values {
            let s = v.as_str()?;
            if K3_MARKER_TEXTS.iter().any(|m| s.contains(m)) {
                return None;
            }
            alts.push(regex_escape(s));
        }
        return Some(Variant::Raw(format!("/(?:{})/", alts.join("|"))));
    }
    Some(Variant::Json(
        xtml_type(first),
        serde_json::json!({ "enum": values }),
    ))
}

/// The raw-text terminal of a string schema; `None` if it has a `format`
/// or a pattern the regex engine does not accept.
fn string_terminal(obj: &Map<String, Value>) -> Option<String> {
    if obj.contains_key("format") {
        return None;
    }
    let min = match obj.get("minLength") {
        None => 0,
        Some(v) => v.as_u64()?,
    };
    let max = match obj.get("maxLength") {
        None => String::new(),
        Some(v) => v.as_u64()?.to_string(),
    };
    let markers = K3_MARKER_TEXTS
        .iter()
        .map(|m| regex_escape(m))
        .collect::<Vec<_>>()
        .join("|");
    let mut expr = format!("/(?s:.{{{min},{max}}})/ & ~/(?s:.*)(?:{markers})(?s:.*)/");
    if let Some(p) = obj.get("pattern") {
        let rx = llguidance::regex_to_lark(p.as_str()?, "dw");
        // The pattern must compile on its own (anchors at its ends only).
        let mut builder = llguidance::derivre::RegexBuilder::new();
        builder.mk_regex(&rx).ok()?;
        expr.push_str(&format!(" & /{rx}/"));
    }
    Some(expr)
}

/// Whether every `$ref` in `v` points into `#/$defs/` or `#/definitions/`
/// (which [`with_defs`] carries into the narrowed schema).
fn refs_stay_in_defs(v: &Value) -> bool {
    match v {
        Value::Object(o) => o.iter().all(|(k, c)| {
            if k == "$ref" {
                c.as_str()
                    .is_some_and(|r| r.starts_with("#/$defs/") || r.starts_with("#/definitions/"))
            } else {
                refs_stay_in_defs(c)
            }
        }),
        Value::Array(a) => a.iter().all(refs_stay_in_defs),
        _ => true,
    }
}

/// `schema` with the root's `$defs` / `definitions` attached.
fn with_defs(root: &Value, schema: &Value) -> Value {
    let mut s = schema.clone();
    if let (Some(out), Some(r)) = (s.as_object_mut(), root.as_object()) {
        for key in ["$defs", "definitions"] {
            if let Some(d) = r.get(key) {
                out.entry(key).or_insert_with(|| d.clone());
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn plain_objects_become_argument_elements() {
        let s = json!({"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 5},
            "days": {"type": "integer", "minimum": 1},
            "mode": {"enum": ["a", "b", 3]},
            "either": {"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "number"}, {"type": "integer"}]}
        }, "required": ["city"]});
        let props = element_form(&s).expect("element form");
        assert_eq!(props.len(), 4);
        assert!(props[0].2 && !props[1].2);
        assert!(matches!(&props[0].1[..], [Variant::Raw(e)] if e.contains(".{0,5}")));
        assert!(matches!(&props[1].1[..], [Variant::Json("number", _)]));
        assert_eq!(props[2].1.len(), 2);
        // string, null, and one merged number variant
        assert_eq!(props[3].1.len(), 3);
    }

    #[test]
    fn what_elements_cannot_express_falls_back_to_json() {
        for s in [
            json!({"anyOf": [{"type": "object"}]}),
            json!({"type": "object", "minProperties": 1, "properties": {}}),
            json!({"type": "object", "properties": {"d": {"type": "string", "format": "date"}}}),
            json!({"type": "object", "properties": {"d": {"allOf": [{"type": "string"}]}}}),
            json!({"type": "object", "required": ["x"]}),
            json!({"type": "object", "properties": {"d": {"type": "string", "pattern": "(?<=a)b"}}}),
        ] {
            assert!(element_form(&s).is_none(), "{s}");
        }
        let with_ref = json!({"$defs": {"p": {"type": "integer"}}, "type": "object",
            "properties": {"a": {"$ref": "#/$defs/p"}, "b": {"type": "array", "items": {"$ref": "#/$defs/p"}}}});
        let props = element_form(&with_ref).expect("refs resolve");
        let Variant::Json(_, b) = &props[1].1[0] else {
            panic!("array is JSON")
        };
        assert!(with_defs(&with_ref, b).get("$defs").is_some());
    }
}
