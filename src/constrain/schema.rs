//! Checks a JSON schema before it is compiled, so that a bad schema fails
//! with an error naming the keyword or reference and where it is, and
//! resolves the schema's own `$ref`s for the grammar builders.
//!
//! Supported: `type`, `enum`, `const`, `anyOf`, `oneOf`, `allOf`, `$ref`
//! (inside the document: `#/…` pointers and `#name` anchors), `properties`,
//! `required`, `additionalProperties`, `patternProperties`,
//! `min/maxProperties`, `items`, `prefixItems`, `additionalItems`,
//! `min/maxItems`, `min/maxLength`, `pattern`, `format`, `minimum`,
//! `maximum`, `exclusiveMinimum`, `exclusiveMaximum`, `multipleOf`, plus
//! annotations. Rejected: the validation keywords a grammar cannot express
//! ([`UNSUPPORTED`]) and references outside the document.

use serde_json::Value;

use super::CompileError;

/// Keywords of JSON Schema that constrained decoding does not implement.
pub const UNSUPPORTED: [&str; 18] = [
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "$dynamicRef",
    "$dynamicAnchor",
    "$recursiveRef",
    "$recursiveAnchor",
];

/// Keywords whose value is one subschema.
const ONE_SCHEMA: [&str; 4] = ["items", "additionalProperties", "additionalItems", "not"];
/// Keywords whose value is an array of subschemas.
const SCHEMA_LIST: [&str; 4] = ["anyOf", "oneOf", "allOf", "prefixItems"];
/// Keywords whose value maps names to subschemas.
const SCHEMA_MAP: [&str; 4] = ["properties", "patternProperties", "$defs", "definitions"];

/// Escapes one JSON-pointer segment (`~` → `~0`, `/` → `~1`).
fn escape_segment(s: &str) -> String {
    s.replace('~', "~0").replace('/', "~1")
}

/// Decodes `%xx` escapes of a URI fragment.
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
            if let Some(b) = hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Resolves a `$ref` against the document `root`: `#` (the root), `#/a/b`
/// pointers, `#name` anchors (`$anchor`). `None` if it does not resolve.
pub fn resolve_ref<'a>(root: &'a Value, reference: &str) -> Option<&'a Value> {
    let fragment = reference.strip_prefix('#')?;
    if fragment.is_empty() {
        return Some(root);
    }
    if fragment.starts_with('/') {
        return root.pointer(&percent_decode(fragment));
    }
    find_anchor(root, fragment)
}

fn find_anchor<'a>(v: &'a Value, name: &str) -> Option<&'a Value> {
    match v {
        Value::Object(o) => {
            if o.get("$anchor").and_then(Value::as_str) == Some(name) {
                return Some(v);
            }
            o.values().find_map(|c| find_anchor(c, name))
        }
        Value::Array(a) => a.iter().find_map(|c| find_anchor(c, name)),
        _ => None,
    }
}

/// Checks `schema` (context names it in errors: `response_format`,
/// `tool get_weather`): every keyword is supported and every `$ref` resolves.
pub fn check(context: &str, schema: &Value) -> Result<(), CompileError> {
    check_at(context, schema, schema, "")
}

fn check_at(context: &str, root: &Value, v: &Value, pointer: &str) -> Result<(), CompileError> {
    let obj = match v {
        Value::Bool(_) => return Ok(()),
        Value::Object(o) => o,
        other => {
            return Err(CompileError::InvalidSchema {
                context: context.into(),
                detail: format!(
                    "the schema at `{pointer}` must be an object or a boolean, got {}",
                    short(other)
                ),
            })
        }
    };
    if let Some(keyword) = UNSUPPORTED.iter().find(|k| obj.contains_key(**k)) {
        return Err(CompileError::UnsupportedKeyword {
            context: context.into(),
            keyword: keyword.to_string(),
            pointer: pointer.into(),
        });
    }
    if let Some(r) = obj.get("$ref") {
        let reference = r.as_str().ok_or_else(|| CompileError::InvalidSchema {
            context: context.into(),
            detail: format!("`$ref` at `{pointer}` must be a string"),
        })?;
        if resolve_ref(root, reference).is_none() {
            return Err(CompileError::UnresolvedRef {
                context: context.into(),
                reference: reference.into(),
                pointer: pointer.into(),
            });
        }
    }
    for key in ONE_SCHEMA {
        if let Some(sub) = obj.get(key) {
            // `items` may be an array (draft 4 tuples).
            if let Value::Array(list) = sub {
                for (i, s) in list.iter().enumerate() {
                    check_at(context, root, s, &format!("{pointer}/{key}/{i}"))?;
                }
            } else {
                check_at(context, root, sub, &format!("{pointer}/{key}"))?;
            }
        }
    }
    for key in SCHEMA_LIST {
        if let Some(sub) = obj.get(key) {
            let list = sub.as_array().ok_or_else(|| CompileError::InvalidSchema {
                context: context.into(),
                detail: format!("`{key}` at `{pointer}` must be an array"),
            })?;
            for (i, s) in list.iter().enumerate() {
                check_at(context, root, s, &format!("{pointer}/{key}/{i}"))?;
            }
        }
    }
    for key in SCHEMA_MAP {
        if let Some(sub) = obj.get(key) {
            let map = sub.as_object().ok_or_else(|| CompileError::InvalidSchema {
                context: context.into(),
                detail: format!("`{key}` at `{pointer}` must be an object"),
            })?;
            for (name, s) in map {
                check_at(
                    context,
                    root,
                    s,
                    &format!("{pointer}/{key}/{}", escape_segment(name)),
                )?;
            }
        }
    }
    Ok(())
}

/// A value shortened for an error message.
fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 60 {
        let cut = (0..=60).rev().find(|&i| s.is_char_boundary(i)).unwrap_or(0);
        format!("{}…", &s[..cut])
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn unsupported_keywords_are_named_with_their_place() {
        let s = json!({"type": "object", "properties": {"a/b": {"type": "array", "uniqueItems": true}}});
        let e = check("tool f", &s).unwrap_err();
        assert_eq!(
            e,
            CompileError::UnsupportedKeyword {
                context: "tool f".into(),
                keyword: "uniqueItems".into(),
                pointer: "/properties/a~1b".into()
            }
        );
        assert!(
            e.to_string().contains("uniqueItems") && e.to_string().contains("/properties/a~1b")
        );
        let s = json!({"anyOf": [{"type": "string"}, {"not": {"type": "null"}}]});
        assert!(
            matches!(check("x", &s), Err(CompileError::UnsupportedKeyword { pointer, .. }) if pointer == "/anyOf/1")
        );
    }

    #[test]
    fn references_resolve_inside_the_document_only() {
        let s = json!({
            "$defs": {"pos": {"type": "integer", "minimum": 0}, "n": {"$anchor": "num", "type": "number"}},
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/pos"}, "b": {"$ref": "#num"}, "c": {"$ref": "#"}}
        });
        assert!(check("x", &s).is_ok());
        assert_eq!(
            resolve_ref(&s, "#/$defs/pos"),
            Some(&json!({"type": "integer", "minimum": 0}))
        );
        assert_eq!(
            resolve_ref(&s, "#num").and_then(|v| v.get("type")),
            Some(&json!("number"))
        );
        let bad = json!({"properties": {"a": {"$ref": "#/$defs/missing"}}});
        let e = check("response_format", &bad).unwrap_err();
        assert_eq!(e.kind(), "unresolved_schema_ref");
        assert!(
            e.to_string().contains("#/$defs/missing") && e.to_string().contains("/properties/a")
        );
        let remote = json!({"$ref": "https://example.com/s.json"});
        assert_eq!(
            check("x", &remote).unwrap_err().kind(),
            "unresolved_schema_ref"
        );
    }

    #[test]
    fn malformed_schemas_are_invalid_not_panics() {
        assert_eq!(check("x", &json!(3)).unwrap_err().kind(), "invalid_schema");
        assert_eq!(
            check("x", &json!({"anyOf": {}})).unwrap_err().kind(),
            "invalid_schema"
        );
        assert!(check("x", &json!(true)).is_ok());
        assert_eq!(percent_decode("a%25b%2"), "a%b%2");
    }
}
