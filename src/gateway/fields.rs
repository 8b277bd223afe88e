//! Reading client JSON field by field, so that every type error names its
//! field (`` `temperature`: expected a number, got "hot" ``) and unknown
//! top-level keys are ignored, as OpenAI's servers do.

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use super::error::{ApiError, ApiResult};

/// A parsed JSON object with typed, named accessors.
#[derive(Debug, Clone)]
pub struct Fields<'a> {
    /// The object.
    obj: &'a Map<String, Value>,
    /// Prefix for nested field names (`input[2].`), empty at the top.
    prefix: String,
}

/// The JSON type name of a value, for messages.
pub fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Parses a request body: not JSON → `invalid_json`; not an object → `invalid_type`.
pub fn parse_body(bytes: &[u8]) -> ApiResult<Map<String, Value>> {
    let v: Value = serde_json::from_slice(bytes).map_err(ApiError::invalid_json)?;
    match v {
        Value::Object(o) => Ok(o),
        other => Err(ApiError::invalid(
            "invalid_type",
            None,
            format!("the body must be a JSON object, got {}", type_name(&other)),
        )),
    }
}

impl<'a> Fields<'a> {
    /// Accessors over a top-level object.
    pub fn new(obj: &'a Map<String, Value>) -> Fields<'a> {
        Fields {
            obj,
            prefix: String::new(),
        }
    }

    /// Accessors over a nested object whose fields print as `prefix.key`.
    pub fn nested(obj: &'a Map<String, Value>, prefix: &str) -> Fields<'a> {
        Fields {
            obj,
            prefix: format!("{prefix}."),
        }
    }

    /// The printed name of `key`.
    pub fn name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// The raw value, `None` when absent or null.
    pub fn raw(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    /// A typed optional field.
    pub fn get<T: DeserializeOwned>(&self, key: &str, expected: &str) -> ApiResult<Option<T>> {
        match self.raw(key) {
            None => Ok(None),
            Some(v) => serde_json::from_value(v.clone()).map(Some).map_err(|_| {
                let name = self.name(key);
                ApiError::invalid(
                    "invalid_type",
                    Some(&name),
                    format!("`{name}`: expected {expected}, got {}", type_name(v)),
                )
            }),
        }
    }

    /// A required typed field.
    pub fn require<T: DeserializeOwned>(&self, key: &str, expected: &str) -> ApiResult<T> {
        self.get(key, expected)?
            .ok_or_else(|| ApiError::missing(&self.name(key)))
    }

    /// An optional string.
    pub fn str(&self, key: &str) -> ApiResult<Option<String>> {
        self.get(key, "a string")
    }

    /// An optional boolean.
    pub fn bool(&self, key: &str) -> ApiResult<Option<bool>> {
        self.get(key, "a boolean")
    }

    /// An optional float in `[lo, hi]` (`lo` excluded when `lo_open`).
    pub fn float_in(&self, key: &str, lo: f32, hi: f32, lo_open: bool) -> ApiResult<Option<f32>> {
        let Some(x) = self.get::<f64>(key, "a number")? else {
            return Ok(None);
        };
        let x = x as f32;
        let ok = x.is_finite() && (if lo_open { x > lo } else { x >= lo }) && x <= hi;
        if !ok {
            let name = self.name(key);
            let l = if lo_open { "(" } else { "[" };
            return Err(ApiError::invalid(
                "invalid_value",
                Some(&name),
                format!("`{name}` must be in {l}{lo}, {hi}], got {x}"),
            ));
        }
        Ok(Some(x))
    }

    /// An optional integer in `[lo, hi]`.
    pub fn int_in(&self, key: &str, lo: i64, hi: i64) -> ApiResult<Option<i64>> {
        let Some(x) = self.get::<i64>(key, "an integer")? else {
            return Ok(None);
        };
        if x < lo || x > hi {
            let name = self.name(key);
            return Err(ApiError::invalid(
                "invalid_value",
                Some(&name),
                format!("`{name}` must be in [{lo}, {hi}], got {x}"),
            ));
        }
        Ok(Some(x))
    }

    /// An optional array.
    pub fn array(&self, key: &str) -> ApiResult<Option<&'a Vec<Value>>> {
        match self.raw(key) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(v) => {
                let name = self.name(key);
                Err(ApiError::invalid(
                    "invalid_type",
                    Some(&name),
                    format!("`{name}`: expected an array, got {}", type_name(v)),
                ))
            }
        }
    }

    /// An optional object.
    pub fn object(&self, key: &str) -> ApiResult<Option<&'a Map<String, Value>>> {
        match self.raw(key) {
            None => Ok(None),
            Some(Value::Object(o)) => Ok(Some(o)),
            Some(v) => {
                let name = self.name(key);
                Err(ApiError::invalid(
                    "invalid_type",
                    Some(&name),
                    format!("`{name}`: expected an object, got {}", type_name(v)),
                ))
            }
        }
    }
}

/// `value` as an object, or an `invalid_type` error naming `name`.
pub fn as_object<'a>(value: &'a Value, name: &str) -> ApiResult<&'a Map<String, Value>> {
    value.as_object().ok_or_else(|| {
        ApiError::invalid(
            "invalid_type",
            Some(name),
            format!("`{name}`: expected an object, got {}", type_name(value)),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_errors_name_the_field() {
        let body = parse_body(br#"{"temperature":"hot","n":{"x":1}}"#).unwrap();
        let f = Fields::new(&body);
        let e = f.float_in("temperature", 0.0, 2.0, false).unwrap_err();
        assert_eq!(e.code, "invalid_type");
        assert_eq!(e.param.as_deref(), Some("temperature"));
        assert!(e.message.contains("a string"), "{}", e.message);
        let inner = f.object("n").unwrap().unwrap();
        let e = Fields::nested(inner, "n").str("x").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("n.x"));
    }

    #[test]
    fn range_errors_name_the_limit() {
        let body = parse_body(br#"{"top_p":0}"#).unwrap();
        let e = Fields::new(&body)
            .float_in("top_p", 0.0, 1.0, true)
            .unwrap_err();
        assert_eq!(e.message, "`top_p` must be in (0, 1], got 0");
        assert_eq!(parse_body(b"[1]").unwrap_err().code, "invalid_type");
        assert_eq!(parse_body(b"{").unwrap_err().code, "invalid_json");
    }
}
