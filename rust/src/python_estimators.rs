//! Binding of the work model's robust line (`crate::estimators`); see kvroute/_native.pyi.

use crate::estimators::ResistantLine;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

pub(crate) fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyResistantLine>()
}

/// `y = intercept + slope * x` fitted robustly to (size, seconds) samples.
#[pyclass(name = "ResistantLine", module = "kvroute._native")]
pub struct PyResistantLine {
    inner: ResistantLine,
}

#[pymethods]
impl PyResistantLine {
    #[new]
    #[pyo3(signature = (slope, intercept = 0.0, window = 16, min_samples = 3))]
    fn new(slope: f64, intercept: f64, window: usize, min_samples: usize) -> PyResult<Self> {
        if window < 1 || min_samples < 1 {
            return Err(PyValueError::new_err(
                "window and min_samples must be at least 1",
            ));
        }
        Ok(PyResistantLine {
            inner: ResistantLine::new(slope, intercept, window, min_samples),
        })
    }

    fn observe(&mut self, x: f64, y: f64) {
        self.inner.observe(x, y);
    }

    #[getter]
    fn slope(&self) -> f64 {
        self.inner.slope
    }

    #[getter]
    fn intercept(&self) -> f64 {
        self.inner.intercept
    }

    #[getter]
    fn samples(&self) -> usize {
        self.inner.samples()
    }

    /// (intercept, slope) once `min_samples` samples came, else None: what the work
    /// model reads for every worker at every decision, in one call.
    #[getter]
    fn learned(&self) -> Option<(f64, f64)> {
        if self.inner.samples() >= self.inner.min_samples() {
            Some((self.inner.intercept, self.inner.slope))
        } else {
            None
        }
    }

    #[getter]
    fn prior(&self) -> (f64, f64) {
        self.inner.prior()
    }

    #[getter]
    fn window(&self) -> usize {
        self.inner.window()
    }

    #[getter]
    fn min_samples(&self) -> usize {
        self.inner.min_samples()
    }

    fn class_counts(&self) -> Vec<(u32, usize)> {
        self.inner.class_counts()
    }

    fn __repr__(&self) -> String {
        format!(
            "ResistantLine(intercept={}, slope={}, samples={})",
            self.inner.intercept,
            self.inner.slope,
            self.inner.samples()
        )
    }
}
