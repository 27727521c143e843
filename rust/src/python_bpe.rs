//! The PyO3 binding of the exact byte-level BPE encoder (`crate::bpe`), kept apart from
//! the index binding (`python.rs`, whose module init calls `add`). Arguments are
//! converted first, then the work runs with the GIL released; IDs come back as an
//! `array('I')`, which the index takes with one memcpy. `SegmentEncoder` wraps
//! `bpe::SegmentEncoder` (rendered text -> IDs through the segment cache) around a
//! `BpeEncoder`'s encoder, shared, not copied.

use crate::bpe;
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyType};
use std::collections::HashMap;
use std::sync::Arc;

/// Adds the BPE classes and functions to the extension module.
pub(crate) fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyBpeEncoder>()?;
    m.add_class::<PySegmentEncoder>()?;
    m.add_function(wrap_pyfunction!(bpe_char_classes, m)?)?;
    Ok(())
}

/// `array.array('I', ...)` of `ids`: one copy into a bytes object, one into the array.
fn u32_array<'py>(py: Python<'py>, ids: &[u32]) -> PyResult<Bound<'py, PyAny>> {
    static ARRAY: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    let array = ARRAY.import(py, "array", "array")?;
    // SAFETY: any initialized u32 memory is valid as bytes, u8 has alignment 1, and the
    // view covers exactly the slice's memory while `ids` is borrowed.
    let raw = unsafe { std::slice::from_raw_parts(ids.as_ptr().cast::<u8>(), ids.len() * 4) };
    array.call1(("I", PyBytes::new(py, raw)))
}

/// Exact byte-level BPE encoder (see kvroute/_native.pyi).
#[pyclass(name = "BpeEncoder", module = "kvroute._native", frozen)]
pub struct PyBpeEncoder {
    inner: Arc<bpe::Encoder>,
}

#[pymethods]
impl PyBpeEncoder {
    #[new]
    #[pyo3(signature = (vocab, merges, patterns, ignore_merges = false, refused = None))]
    fn new(
        py: Python<'_>,
        vocab: &Bound<'_, PyDict>,
        merges: &Bound<'_, PyAny>,
        patterns: Vec<String>,
        ignore_merges: bool,
        refused: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let mut tokens = Vec::with_capacity(vocab.len());
        for (token, id) in vocab.iter() {
            tokens.push((token.extract::<Vec<u8>>()?, id.extract::<u32>()?));
        }
        let mut pairs = Vec::new();
        for item in merges.try_iter()? {
            pairs.push(item?.extract::<(Vec<u8>, Vec<u8>)>()?);
        }
        let refused = match refused {
            Some(r) if !r.is_none() => Some(PyBuffer::<u32>::get(r)?.to_vec(py)?),
            _ => None,
        };
        let patterns: Vec<&str> = patterns.iter().map(String::as_str).collect();
        let inner = py.detach(|| {
            bpe::Encoder::new(tokens, &pairs, &patterns, ignore_merges, refused.as_deref())
        });
        inner
            .map(|inner| PyBpeEncoder {
                inner: Arc::new(inner),
            })
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// The IDs of `text` as an `array('I')`, or None (refused character, or a string
    /// that is not valid UTF-8).
    fn encode<'py>(
        &self,
        py: Python<'py>,
        text: &Bound<'py, PyString>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let Ok(text) = text.to_str() else {
            return Ok(None);
        };
        match py.detach(|| self.inner.encode(text)) {
            Some(ids) => u32_array(py, &ids).map(Some),
            None => Ok(None),
        }
    }

    /// The pre-tokenizer's pieces of `text`.
    fn split<'py>(&self, text: &Bound<'py, PyString>) -> PyResult<Vec<String>> {
        let text = text.to_str()?;
        Ok(self
            .inner
            .split(text)
            .into_iter()
            .map(String::from)
            .collect())
    }

    /// The pre-tokenizer scheme: "qwen2", "llama3" or "deepseek-v3".
    #[getter]
    fn scheme(&self) -> &'static str {
        match self.inner.scheme() {
            bpe::Scheme::Gpt4 { digits: 1 } => "qwen2",
            bpe::Scheme::Gpt4 { .. } => "llama3",
            bpe::Scheme::DeepSeekV3 => "deepseek-v3",
        }
    }

    /// Tokens the whole-piece fast path knows.
    #[getter]
    fn whole_tokens(&self) -> usize {
        self.inner.whole_tokens()
    }
}

/// Rendered text -> IDs through a segment cache (see kvroute/_native.pyi).
#[pyclass(name = "SegmentEncoder", module = "kvroute._native", frozen)]
pub struct PySegmentEncoder {
    inner: bpe::SegmentEncoder,
}

#[pymethods]
impl PySegmentEncoder {
    #[new]
    #[pyo3(signature = (encoder, specials, prefix, unstable, *, speed, cache_size, cache_bytes))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        encoder: &Bound<'_, PyBpeEncoder>,
        specials: &Bound<'_, PyDict>,
        prefix: Vec<u32>,
        unstable: Option<&Bound<'_, PyAny>>,
        speed: (u64, u64),
        cache_size: usize,
        cache_bytes: usize,
    ) -> PyResult<Self> {
        let mut tokens = Vec::with_capacity(specials.len());
        for (token, id) in specials.iter() {
            tokens.push((token.extract::<String>()?, id.extract::<u32>()?));
        }
        let unstable = match unstable {
            Some(u) if !u.is_none() => Some(PyBuffer::<u32>::get(u)?.to_vec(py)?),
            _ => None,
        };
        let settings = bpe::Settings {
            max_entries: cache_size,
            max_bytes: cache_bytes,
            ascii_ns: speed.0,
            other_ns: speed.1,
        };
        let encoder = encoder.get().inner.clone();
        let inner = py.detach(|| {
            bpe::SegmentEncoder::new(encoder, &tokens, prefix, unstable.as_deref(), settings)
        });
        inner
            .map(|inner| PySegmentEncoder { inner })
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// The IDs of `text` as an `array('I')`; None when encoding the pieces not cached
    /// would cost more than `budget_ns`; or the pieces the caller must encode (a list).
    #[pyo3(signature = (text, add_special_tokens = false, budget_ns = None, given = None))]
    fn encode<'py>(
        &self,
        py: Python<'py>,
        text: &Bound<'py, PyString>,
        add_special_tokens: bool,
        budget_ns: Option<u64>,
        given: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let text = text.to_str()?;
        let mut known = HashMap::new();
        if let Some(given) = given {
            for (piece, ids) in given.iter() {
                let ids = match PyBuffer::<u32>::get(&ids) {
                    Ok(buffer) => buffer.to_vec(py)?,
                    Err(_) => ids.extract::<Vec<u32>>()?,
                };
                known.insert(piece.extract::<String>()?, ids);
            }
        }
        match py.detach(|| {
            self.inner
                .encode(text, add_special_tokens, budget_ns, &known)
        }) {
            bpe::Encoded::Ids(ids) => u32_array(py, &ids),
            bpe::Encoded::TooLong => Ok(py.None().into_bound(py)),
            bpe::Encoded::ForCaller(pieces) => Ok(PyList::new(py, pieces)?.into_any()),
        }
    }

    /// Segment-cache hits (pieces found), counted per piece.
    #[getter]
    fn hits(&self) -> u64 {
        self.inner.stats().hits
    }

    /// Segment-cache misses (pieces encoded), counted per piece.
    #[getter]
    fn misses(&self) -> u64 {
        self.inner.stats().misses
    }

    /// Entries in the segment cache.
    #[getter]
    fn entries(&self) -> usize {
        self.inner.stats().entries
    }

    /// What the entries are counted as, in bytes.
    #[getter]
    fn bytes(&self) -> usize {
        self.inner.stats().bytes
    }

    /// The cached pieces, most recent first.
    fn cached(&self) -> Vec<String> {
        self.inner.cached().iter().map(|k| k.to_string()).collect()
    }

    /// Empties the segment cache (the counters stay).
    fn clear(&self) {
        self.inner.clear();
    }
}

/// One byte of class flags per character of `text` (1 letter, 2 number, 4 whitespace,
/// 8 mark, 16 punctuation, 32 symbol), as the encoder's pre-tokenizer sees them.
#[pyfunction]
fn bpe_char_classes<'py>(
    py: Python<'py>,
    text: &Bound<'py, PyString>,
) -> PyResult<Bound<'py, PyBytes>> {
    let text = text.to_str()?;
    let flags = py.detach(|| bpe::flags_of(text));
    Ok(PyBytes::new(py, &flags))
}
