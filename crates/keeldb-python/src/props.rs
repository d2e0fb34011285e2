//! Properties of nodes and edges: JSON-compatible Python dicts stored as compact UTF-8 JSON
//! (no spaces; an empty dict is stored as zero bytes). Encoding walks the Python objects
//! directly into bytes and decoding builds Python objects straight from the parser, so no
//! intermediate tree is allocated either way. Key order is kept.
//!
//! Accepted values: `None`, `bool`, `int` (64-bit: -2**63 .. 2**64-1), finite `float`, `str`,
//! `list`/`tuple` (stored as lists) and `dict` with `str` keys, nested up to 64 levels deep.
//! Anything else is a `TypeError`; a non-finite float, an int outside 64 bits or deeper nesting
//! (which is also what a self-referencing list looks like) is a `ValueError`.

use std::fmt;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

const MAX_DEPTH: usize = 64;

/// Encodes an optional properties dict (`None` means no properties).
pub fn encode(props: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<u8>> {
    let mut out = Vec::new();
    let Some(props) = props.filter(|p| !p.is_none()) else { return Ok(out) };
    let dict = props
        .downcast::<PyDict>()
        .map_err(|_| PyTypeError::new_err(format!("properties must be a dict, not {}", type_name(props))))?;
    if dict.is_empty() {
        return Ok(out);
    }
    write_dict(&mut out, dict, 0)?;
    Ok(out)
}

/// Decodes stored properties into a new dict.
pub fn decode<'py>(py: Python<'py>, bytes: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    if bytes.is_empty() {
        return Ok(PyDict::new(py).into_any());
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = ValueSeed { py }.deserialize(&mut de).map_err(|e| corrupt(py, &e.to_string()))?;
    de.end().map_err(|e| corrupt(py, &e.to_string()))?;
    if !value.is_instance_of::<PyDict>() {
        return Err(corrupt(py, "stored properties are not a JSON object"));
    }
    Ok(value)
}

fn corrupt(py: Python<'_>, why: &str) -> PyErr {
    crate::errors::new_error(py, "CorruptionError", format!("stored properties do not decode as JSON: {why}"))
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map_or_else(|_| "?".to_owned(), |n| n.to_string())
}

fn write_str(out: &mut Vec<u8>, s: &str) -> PyResult<()> {
    serde_json::to_writer(&mut *out, s).map_err(|e| PyValueError::new_err(e.to_string()))
}

fn write_dict(out: &mut Vec<u8>, dict: &Bound<'_, PyDict>, depth: usize) -> PyResult<()> {
    out.push(b'{');
    for (i, (k, v)) in dict.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        let key = k
            .downcast::<PyString>()
            .map_err(|_| PyTypeError::new_err(format!("property keys must be str, not {}", type_name(&k))))?;
        write_str(out, &key.to_cow()?)?;
        out.push(b':');
        write_value(out, &v, depth + 1)?;
    }
    out.push(b'}');
    Ok(())
}

fn write_value(out: &mut Vec<u8>, v: &Bound<'_, PyAny>, depth: usize) -> PyResult<()> {
    if depth > MAX_DEPTH {
        return Err(PyValueError::new_err(format!(
            "properties are nested deeper than {MAX_DEPTH} levels (or refer to themselves)"
        )));
    }
    if v.is_none() {
        out.extend_from_slice(b"null");
    } else if let Ok(b) = v.downcast::<PyBool>() {
        out.extend_from_slice(if b.is_true() { b"true" } else { b"false" });
    } else if v.is_instance_of::<PyInt>() {
        write_int(out, v)?;
    } else if let Ok(f) = v.downcast::<PyFloat>() {
        let f = f.value();
        if !f.is_finite() {
            return Err(PyValueError::new_err(format!("property value {f} is not finite; JSON cannot hold it")));
        }
        serde_json::to_writer(&mut *out, &f).map_err(|e| PyValueError::new_err(e.to_string()))?;
    } else if let Ok(s) = v.downcast::<PyString>() {
        write_str(out, &s.to_cow()?)?;
    } else if let Ok(d) = v.downcast::<PyDict>() {
        write_dict(out, d, depth)?;
    } else if let Ok(l) = v.downcast::<PyList>() {
        write_seq(out, l.iter(), depth)?;
    } else if let Ok(t) = v.downcast::<PyTuple>() {
        write_seq(out, t.iter(), depth)?;
    } else {
        return Err(PyTypeError::new_err(format!(
            "property values must be None, bool, int, float, str, list, tuple or dict, not {}",
            type_name(v)
        )));
    }
    Ok(())
}

fn write_int(out: &mut Vec<u8>, v: &Bound<'_, PyAny>) -> PyResult<()> {
    let text = if let Ok(i) = v.extract::<i64>() {
        i.to_string()
    } else if let Ok(u) = v.extract::<u64>() {
        u.to_string()
    } else {
        return Err(PyValueError::new_err("property integers must fit in 64 bits (-2**63 .. 2**64-1)"));
    };
    out.extend_from_slice(text.as_bytes());
    Ok(())
}

fn write_seq<'py>(out: &mut Vec<u8>, items: impl Iterator<Item = Bound<'py, PyAny>>, depth: usize) -> PyResult<()> {
    out.push(b'[');
    for (i, item) in items.enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write_value(out, &item, depth + 1)?;
    }
    out.push(b']');
    Ok(())
}

/// Builds Python objects directly from the JSON parser.
#[derive(Clone, Copy)]
struct ValueSeed<'py> {
    py: Python<'py>,
}

impl<'de, 'py> DeserializeSeed<'de> for ValueSeed<'py> {
    type Value = Bound<'py, PyAny>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

fn de_err<E: serde::de::Error>(e: PyErr) -> E {
    E::custom(e.to_string())
}

impl<'de, 'py> Visitor<'de> for ValueSeed<'py> {
    type Value = Bound<'py, PyAny>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        Ok(self.py.None().into_bound(self.py))
    }
    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Self::Value, E> {
        Ok(PyBool::new(self.py, v).to_owned().into_any())
    }
    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Self::Value, E> {
        Ok(v.into_pyobject(self.py).map(Bound::into_any).unwrap_or_else(|never| match never {}))
    }
    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
        Ok(v.into_pyobject(self.py).map(Bound::into_any).unwrap_or_else(|never| match never {}))
    }
    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Self::Value, E> {
        Ok(PyFloat::new(self.py, v).into_any())
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(PyString::new(self.py, v).into_any())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let list = PyList::empty(self.py);
        while let Some(item) = seq.next_element_seed(self)? {
            list.append(item).map_err(de_err)?;
        }
        Ok(list.into_any())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let dict = PyDict::new(self.py);
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            let value = map.next_value_seed(self)?;
            dict.set_item(key.as_ref(), value).map_err(de_err)?;
        }
        Ok(dict.into_any())
    }
}
