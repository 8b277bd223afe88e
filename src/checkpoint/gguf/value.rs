//! GGUF metadata values: the thirteen value types of the spec, arrays included.

use std::fmt;

/// The type tag of a metadata value (`gguf_type` in the spec).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgufValueType {
    /// u8 (tag 0).
    U8,
    /// i8 (tag 1).
    I8,
    /// u16 (tag 2).
    U16,
    /// i16 (tag 3).
    I16,
    /// u32 (tag 4).
    U32,
    /// i32 (tag 5).
    I32,
    /// f32 (tag 6).
    F32,
    /// bool stored as one byte, 0 or 1 (tag 7).
    Bool,
    /// Length-prefixed UTF-8 string (tag 8).
    String,
    /// Typed array (tag 9).
    Array,
    /// u64 (tag 10).
    U64,
    /// i64 (tag 11).
    I64,
    /// f64 (tag 12).
    F64,
}

impl GgufValueType {
    /// The type for on-disk tag `tag`.
    pub fn from_tag(tag: u32) -> Option<GgufValueType> {
        use GgufValueType::*;
        Some(match tag {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The on-disk tag.
    pub fn tag(self) -> u32 {
        use GgufValueType::*;
        match self {
            U8 => 0,
            I8 => 1,
            U16 => 2,
            I16 => 3,
            U32 => 4,
            I32 => 5,
            F32 => 6,
            Bool => 7,
            String => 8,
            Array => 9,
            U64 => 10,
            I64 => 11,
            F64 => 12,
        }
    }
}

impl fmt::Display for GgufValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self:?}")
    }
}

/// An array metadata value: its element type (kept so empty arrays stay typed) and
/// its elements.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufArray {
    /// The declared element type; every element has it.
    pub elem_type: GgufValueType,
    /// The elements, in file order.
    pub values: Vec<GgufValue>,
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    /// u8.
    U8(u8),
    /// i8.
    I8(i8),
    /// u16.
    U16(u16),
    /// i16.
    I16(i16),
    /// u32 (most hyper-parameters).
    U32(u32),
    /// i32.
    I32(i32),
    /// f32 (eps, rope base).
    F32(f32),
    /// bool.
    Bool(bool),
    /// UTF-8 string.
    String(String),
    /// Typed array (token lists, merges, token types).
    Array(GgufArray),
    /// u64.
    U64(u64),
    /// i64.
    I64(i64),
    /// f64.
    F64(f64),
}

impl GgufValue {
    /// The value's type tag.
    pub fn value_type(&self) -> GgufValueType {
        use GgufValueType as T;
        match self {
            GgufValue::U8(_) => T::U8,
            GgufValue::I8(_) => T::I8,
            GgufValue::U16(_) => T::U16,
            GgufValue::I16(_) => T::I16,
            GgufValue::U32(_) => T::U32,
            GgufValue::I32(_) => T::I32,
            GgufValue::F32(_) => T::F32,
            GgufValue::Bool(_) => T::Bool,
            GgufValue::String(_) => T::String,
            GgufValue::Array(_) => T::Array,
            GgufValue::U64(_) => T::U64,
            GgufValue::I64(_) => T::I64,
            GgufValue::F64(_) => T::F64,
        }
    }

    /// Any integer value that fits in u64 (negative ones give `None`).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v as u64),
            GgufValue::U16(v) => Some(v as u64),
            GgufValue::U32(v) => Some(v as u64),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer value that fits in i64.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            GgufValue::U8(v) => Some(v as i64),
            GgufValue::U16(v) => Some(v as i64),
            GgufValue::U32(v) => Some(v as i64),
            GgufValue::U64(v) => i64::try_from(v).ok(),
            GgufValue::I8(v) => Some(v as i64),
            GgufValue::I16(v) => Some(v as i64),
            GgufValue::I32(v) => Some(v as i64),
            GgufValue::I64(v) => Some(v),
            _ => None,
        }
    }

    /// A float value, or an integer widened to f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v as f64),
            GgufValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    /// A bool value.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    /// A string value.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// An array value.
    pub fn as_array(&self) -> Option<&GgufArray> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }

    /// A short human-readable type name, e.g. `u32` or `[string; 49152]`.
    pub fn type_name(&self) -> String {
        match self {
            GgufValue::Array(a) => format!("[{:?}; {}]", a.elem_type, a.values.len()),
            v => format!("{:?}", v.value_type()),
        }
    }
}

/// Longest string or number of array elements [`GgufValue`]'s `Display` prints in full.
const DISPLAY_MAX: usize = 6;
/// Longest string [`GgufValue`]'s `Display` prints before eliding.
const DISPLAY_MAX_CHARS: usize = 80;

impl fmt::Display for GgufValue {
    /// Prints the value, eliding long strings and long arrays, so `inspect` output
    /// stays one line per key.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GgufValue::U8(v) => write!(f, "{v}"),
            GgufValue::I8(v) => write!(f, "{v}"),
            GgufValue::U16(v) => write!(f, "{v}"),
            GgufValue::I16(v) => write!(f, "{v}"),
            GgufValue::U32(v) => write!(f, "{v}"),
            GgufValue::I32(v) => write!(f, "{v}"),
            GgufValue::U64(v) => write!(f, "{v}"),
            GgufValue::I64(v) => write!(f, "{v}"),
            GgufValue::F32(v) => write!(f, "{v:e}"),
            GgufValue::F64(v) => write!(f, "{v:e}"),
            GgufValue::Bool(v) => write!(f, "{v}"),
            GgufValue::String(s) => {
                if s.chars().count() > DISPLAY_MAX_CHARS {
                    let head: String = s.chars().take(DISPLAY_MAX_CHARS).collect();
                    write!(f, "{:?}… ({} chars)", head, s.chars().count())
                } else {
                    write!(f, "{s:?}")
                }
            }
            GgufValue::Array(a) => {
                f.write_str("[")?;
                for (i, v) in a.values.iter().take(DISPLAY_MAX).enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{v}")?;
                }
                if a.values.len() > DISPLAY_MAX {
                    write!(f, ", … {} {:?} in all", a.values.len(), a.elem_type)?;
                }
                f.write_str("]")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_elides_long_arrays_and_strings() {
        let v = GgufValue::Array(GgufArray {
            elem_type: GgufValueType::U32,
            values: (0..100).map(GgufValue::U32).collect(),
        });
        assert_eq!(v.to_string(), "[0, 1, 2, 3, 4, 5, … 100 U32 in all]");
        let s = GgufValue::String("x".repeat(200));
        assert!(s.to_string().ends_with("… (200 chars)"));
        assert_eq!(v.type_name(), "[U32; 100]");
    }
}
