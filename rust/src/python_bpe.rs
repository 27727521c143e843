//! The PyO3 binding of the exact byte-level BPE encoder (`crate::bpe`), kept apart from
//! the index binding (`python.rs`, whose module init calls `add`). Arguments are
//! converted first, then the work runs with the GIL released; IDs come back as an
//! `array('I')`, which the index takes with one memcpy.

use crate::bpe;
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyString, PyType};

/// Adds the BPE classes and functions to the extension module.
pub(crate) fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyBpeEncoder>()?;
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
    inner: bpe::Encoder,
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
            .map(|inner| PyBpeEncoder { inner })
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
