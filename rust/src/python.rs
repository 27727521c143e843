//! The thin PyO3 binding: argument conversion, then the work with the GIL released.
//!
//! Tokens arrive as any object exporting a 1-D buffer of u32 (`array.array('I')`, a NumPy
//! `uint32` array): one memcpy, no per-element conversion. Any other iterable of ints is
//! converted element by element with a range check, except `bytes` and `bytearray`: one
//! token per byte (the no-tokenizer mode's UTF-8 prompt), widened here in one pass.
//! A byte-token index (`PrefixIndex(byte_tokens=True)`) takes the same containers and
//! narrows them, refusing IDs above 255. Conversion happens before the index is touched,
//! so a bad argument never leaves the index half-changed.

use crate::blocks::{BlockIndex, EventError};
use crate::tree::{ByteIndex, PrefixIndex, Symbol, Tree, Walk};
use parking_lot::{Mutex, RwLock};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyList, PyString, PyTuple};
use std::sync::Arc;

/// Token IDs as an index reads them: converted from a Python container, or shared
/// with a `TokenIds` handle (converted by an earlier call, never copied again).
enum Tokens<T = u32> {
    Owned(Vec<T>),
    Shared(Arc<Vec<T>>),
}

impl<T> std::ops::Deref for Tokens<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            Tokens::Owned(v) => v,
            Tokens::Shared(v) => v,
        }
    }
}

impl<T> Tokens<T> {
    /// Shareable without a copy (the Vec moves behind the Arc).
    fn into_shared(self) -> Arc<Vec<T>> {
        match self {
            Tokens::Owned(v) => Arc::new(v),
            Tokens::Shared(v) => v,
        }
    }
}

/// A `TokenIds` handle's tokens, as the index that made it stores them.
enum Ids {
    Wide(Arc<Vec<u32>>),
    Bytes(Arc<Vec<u8>>),
}

/// A prompt's token IDs as `PrefixIndex.lookup` converted them, handed back so that the
/// same decision's `insert` (or any call taking tokens) reads them without converting
/// or copying them again, nor (an insert into the same, unchanged index) walking again
/// the nodes they matched whole. Immutable.
#[pyclass(name = "TokenIds", module = "kvroute._native", frozen)]
pub struct PyTokenIds {
    ids: Ids,
    /// The lookup's walk: an insert of these tokens into the same, unchanged index
    /// resumes below it (`PrefixIndex::insert_after`).
    walk: Walk,
}

impl PyTokenIds {
    fn len(&self) -> usize {
        match &self.ids {
            Ids::Wide(v) => v.len(),
            Ids::Bytes(v) => v.len(),
        }
    }
}

#[pymethods]
impl PyTokenIds {
    fn __len__(&self) -> usize {
        self.len()
    }

    fn __repr__(&self) -> String {
        format!("TokenIds(<{} tokens>)", self.len())
    }
}

/// A token type the binding converts Python containers into.
trait PySymbol: Symbol {
    /// `obj`'s tokens (shared with a `TokenIds` handle of the same type).
    fn extract(obj: &Bound<'_, PyAny>) -> PyResult<Tokens<Self>>;
    /// A handle's tokens, when stored as `Self` (shared, no copy).
    fn shared(ids: &Ids) -> Option<Arc<Vec<Self>>>;
    fn wrap(ids: Arc<Vec<Self>>) -> Ids;
}

impl PySymbol for u32 {
    fn extract(obj: &Bound<'_, PyAny>) -> PyResult<Tokens<u32>> {
        if let Ok(t) = obj.downcast::<PyTokenIds>() {
            return Ok(match &t.get().ids {
                Ids::Wide(v) => Tokens::Shared(Arc::clone(v)),
                Ids::Bytes(v) => Tokens::Owned(v.iter().map(|&b| u32::from(b)).collect()),
            });
        }
        extract_owned(obj).map(Tokens::Owned)
    }

    fn shared(ids: &Ids) -> Option<Arc<Vec<u32>>> {
        match ids {
            Ids::Wide(v) => Some(Arc::clone(v)),
            Ids::Bytes(_) => None,
        }
    }

    fn wrap(ids: Arc<Vec<u32>>) -> Ids {
        Ids::Wide(ids)
    }
}

impl PySymbol for u8 {
    fn extract(obj: &Bound<'_, PyAny>) -> PyResult<Tokens<u8>> {
        if let Ok(t) = obj.downcast::<PyTokenIds>() {
            return match &t.get().ids {
                Ids::Bytes(v) => Ok(Tokens::Shared(Arc::clone(v))),
                Ids::Wide(v) => narrow(v).map(Tokens::Owned),
            };
        }
        if let Ok(b) = obj.downcast::<PyBytes>() {
            return Ok(Tokens::Owned(b.as_bytes().to_vec()));
        }
        if let Ok(b) = obj.downcast::<PyByteArray>() {
            return Ok(Tokens::Owned(b.to_vec()));
        }
        narrow(&extract_owned(obj)?).map(Tokens::Owned)
    }

    fn shared(ids: &Ids) -> Option<Arc<Vec<u8>>> {
        match ids {
            Ids::Bytes(v) => Some(Arc::clone(v)),
            Ids::Wide(_) => None,
        }
    }

    fn wrap(ids: Arc<Vec<u8>>) -> Ids {
        Ids::Bytes(ids)
    }
}

fn byte_error(i: usize, v: u32) -> PyErr {
    PyValueError::new_err(format!(
        "token ID at position {i} is {v}, outside [0, 255] (a byte-token index)"
    ))
}

/// `ids` as bytes (two passes over them, each compiled to vector instructions).
fn narrow(ids: &[u32]) -> PyResult<Vec<u8>> {
    if ids.iter().fold(0, |a, &v| a | v) > 255 {
        let i = ids.iter().position(|&v| v > 255).unwrap_or(0);
        return Err(byte_error(i, ids[i]));
    }
    Ok(ids.iter().map(|&v| v as u8).collect())
}

/// Convert a Python token container into u32s.
fn extract_tokens(obj: &Bound<'_, PyAny>) -> PyResult<Tokens> {
    u32::extract(obj)
}

fn extract_owned(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    if obj.is_instance_of::<PyString>() {
        return Err(PyTypeError::new_err(
            "tokens must be a sequence of int token IDs or a uint32 buffer, not str \
             (tokenize the text first)",
        ));
    }
    if let Ok(b) = obj.downcast::<PyBytes>() {
        return Ok(b.as_bytes().iter().map(|&x| u32::from(x)).collect());
    }
    if let Ok(b) = obj.downcast::<PyByteArray>() {
        return Ok(b.to_vec().into_iter().map(u32::from).collect());
    }
    if let Ok(buf) = PyBuffer::<u32>::get(obj) {
        if buf.dimensions() != 1 {
            return Err(PyValueError::new_err(format!(
                "token buffer must be 1-dimensional, got {} dimensions",
                buf.dimensions()
            )));
        }
        return buf.to_vec(obj.py());
    }
    if let Ok(list) = obj.downcast::<PyList>() {
        let mut out = Vec::with_capacity(list.len());
        for (i, item) in list.iter().enumerate() {
            out.push(token_at(&item, i)?);
        }
        return Ok(out);
    }
    if let Ok(tuple) = obj.downcast::<PyTuple>() {
        let mut out = Vec::with_capacity(tuple.len());
        for (i, item) in tuple.iter().enumerate() {
            out.push(token_at(&item, i)?);
        }
        return Ok(out);
    }
    let iter = obj.try_iter().map_err(|_| {
        PyTypeError::new_err(format!(
            "tokens must be a sequence of int token IDs or a uint32 buffer, not {}",
            type_name(obj)
        ))
    })?;
    let mut out = Vec::new();
    for (i, item) in iter.enumerate() {
        out.push(token_at(&item?, i)?);
    }
    Ok(out)
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

#[inline]
fn token_at(item: &Bound<'_, PyAny>, i: usize) -> PyResult<u32> {
    if let Ok(v) = item.extract::<u32>() {
        return Ok(v);
    }
    match item.extract::<i128>() {
        Ok(v) => Err(PyValueError::new_err(format!(
            "token ID at position {i} is {v}, outside [0, 4294967295]"
        ))),
        Err(_) => Err(PyTypeError::new_err(format!(
            "token ID at position {i} must be an int, not {}",
            type_name(item)
        ))),
    }
}

/// Prefix index over token IDs shared by a fleet of workers (see kvroute/_native.pyi).
#[pyclass(name = "PrefixIndex", module = "kvroute._native", frozen)]
pub struct PyPrefixIndex {
    inner: Inner,
    /// Python str objects for worker ids, so answers do not build a new str per worker
    /// per call. An entry is valid while its `Arc` is the index's current name handle
    /// for that id (ids are recycled after `remove_worker`).
    names: Mutex<Vec<Option<NameEntry>>>,
}

/// The tree, over u32 token IDs or over bytes (`byte_tokens`).
enum Inner {
    Wide(RwLock<PrefixIndex>),
    Bytes(RwLock<ByteIndex>),
}

/// `$body` with `$t` bound to the index's tree, whichever its token type.
macro_rules! with_tree {
    ($self:expr, $t:ident => $body:expr) => {
        match &$self.inner {
            Inner::Wide($t) => $body,
            Inner::Bytes($t) => $body,
        }
    };
}

type NameEntry = (Arc<str>, Py<PyString>);
/// (worker id, its name handle, matched length): a match answer before the GIL is back.
type Named = Vec<(u32, Arc<str>, u32)>;
/// `lookup`'s answer: per-worker matches, longest match, its holders, the tokens.
type LookupAnswer<'py> = (Bound<'py, PyDict>, u32, Vec<Py<PyString>>, Py<PyTokenIds>);

/// `obj`'s tokens as `tree` stores them.
fn tokens_for<T: PySymbol>(_tree: &RwLock<Tree<T>>, obj: &Bound<'_, PyAny>) -> PyResult<Tokens<T>> {
    T::extract(obj)
}

fn insert_in<T: PySymbol>(
    tree: &RwLock<Tree<T>>,
    py: Python<'_>,
    worker: &str,
    tokens: &Bound<'_, PyAny>,
) -> PyResult<u64> {
    if let Ok(t) = tokens.downcast::<PyTokenIds>() {
        let t = t.get();
        if let Some(ids) = T::shared(&t.ids) {
            let walk = &t.walk;
            return Ok(py.detach(|| tree.write().insert_after(worker, &ids, walk).held_before));
        }
    }
    let tokens = T::extract(tokens)?;
    Ok(py.detach(|| tree.write().insert(worker, &tokens).held_before))
}

fn match_in<T: PySymbol>(tree: &RwLock<Tree<T>>, py: Python<'_>, tokens: &[T]) -> Named {
    py.detach(|| {
        let g = tree.read();
        g.match_all_ids(tokens)
            .into_iter()
            .map(|(id, len)| (id, g.name_handle(id), len))
            .collect()
    })
}

fn lookup_in<T: PySymbol>(
    tree: &RwLock<Tree<T>>,
    py: Python<'_>,
    tokens: &Bound<'_, PyAny>,
) -> PyResult<(Named, u32, usize, PyTokenIds)> {
    let tokens = T::extract(tokens)?.into_shared();
    let (out, longest, holders, walk) = py.detach(|| {
        let g = tree.read();
        let found = g.lookup_ids(&tokens);
        let out: Named = found
            .matches
            .into_iter()
            .map(|(id, len)| (id, g.name_handle(id), len))
            .collect();
        (out, found.longest, found.holders, found.walk)
    });
    let ids = PyTokenIds {
        ids: T::wrap(tokens),
        walk,
    };
    Ok((out, longest, holders, ids))
}

fn longest_in<T: PySymbol>(
    tree: &RwLock<Tree<T>>,
    py: Python<'_>,
    tokens: &[T],
) -> (u32, Vec<(u32, Arc<str>)>) {
    py.detach(|| {
        let g = tree.read();
        let (len, ids) = g.longest_match_ids(tokens);
        (
            len,
            ids.into_iter().map(|id| (id, g.name_handle(id))).collect(),
        )
    })
}

impl PyPrefixIndex {
    fn py_name(&self, py: Python<'_>, id: u32, handle: &Arc<str>) -> Py<PyString> {
        let mut names = self.names.lock();
        let i = id as usize;
        if names.len() <= i {
            names.resize_with(i + 1, || None);
        }
        if let Some((h, s)) = &names[i] {
            if Arc::ptr_eq(h, handle) {
                return s.clone_ref(py);
            }
        }
        let s = PyString::new(py, handle).unbind();
        names[i] = Some((Arc::clone(handle), s.clone_ref(py)));
        s
    }

    fn named_dict<'py>(&self, py: Python<'py>, out: Named) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (id, handle, len) in out {
            d.set_item(self.py_name(py, id, &handle), len)?;
        }
        Ok(d)
    }
}

/// A token budget from Python: a non-negative int (bool refused).
fn budget_arg(v: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    if v.is_instance_of::<pyo3::types::PyBool>() {
        return Err(PyTypeError::new_err(format!(
            "{what} must be an int or None, not bool"
        )));
    }
    let n: i128 = v.extract().map_err(|_| {
        PyTypeError::new_err(format!(
            "{what} must be an int or None, not {}",
            type_name(v)
        ))
    })?;
    if n < 0 || n > u64::MAX as i128 {
        return Err(PyValueError::new_err(format!(
            "{what} must be >= 0, got {n}"
        )));
    }
    Ok(n as u64)
}

#[pymethods]
impl PyPrefixIndex {
    #[new]
    #[pyo3(signature = (max_tokens_per_worker = None, *, byte_tokens = false))]
    fn new(max_tokens_per_worker: Option<&Bound<'_, PyAny>>, byte_tokens: bool) -> PyResult<Self> {
        let budget = match max_tokens_per_worker {
            None => None,
            Some(v) if v.is_none() => None,
            Some(v) => Some(budget_arg(v, "max_tokens_per_worker")?),
        };
        let inner = if byte_tokens {
            Inner::Bytes(RwLock::new(ByteIndex::new(budget)))
        } else {
            Inner::Wide(RwLock::new(PrefixIndex::new(budget)))
        };
        Ok(PyPrefixIndex {
            inner,
            names: Mutex::new(Vec::new()),
        })
    }

    /// Budget of cached tokens per worker, or None when unbounded.
    #[getter]
    fn max_tokens_per_worker(&self) -> Option<u64> {
        with_tree!(self, t => t.read().max_tokens_per_worker())
    }

    /// Tokens evicted by budget since creation (or the last `clear`): zero while no
    /// budget has bound.
    #[getter]
    fn evicted_tokens(&self) -> u64 {
        with_tree!(self, t => t.read().evicted_tokens())
    }

    /// Whether tokens are bytes (0-255), stored one byte each.
    #[getter]
    fn byte_tokens(&self) -> bool {
        matches!(self.inner, Inner::Bytes(_))
    }

    /// Record that `worker` holds `tokens`; returns how many leading tokens it held
    /// before. Evicts over budget.
    fn insert(&self, py: Python<'_>, worker: &str, tokens: &Bound<'_, PyAny>) -> PyResult<u64> {
        with_tree!(self, t => insert_in(t, py, worker, tokens))
    }

    /// Undo an insert: `worker` stops holding `tokens` past its first `keep` tokens,
    /// except what its other prefixes need. Returns the tokens dropped.
    fn rollback(
        &self,
        py: Python<'_>,
        worker: &str,
        tokens: &Bound<'_, PyAny>,
        keep: u64,
    ) -> PyResult<u64> {
        with_tree!(self, t => {
            let tokens = tokens_for(t, tokens)?;
            Ok(py.detach(|| t.write().rollback(worker, &tokens, keep)))
        })
    }

    /// Matched prefix length per worker that holds any of `tokens`.
    #[pyo3(name = "match")]
    fn match_<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let out = with_tree!(self, t => match_in(t, py, &tokens_for(t, tokens)?));
        self.named_dict(py, out)
    }

    /// What a routing decision reads, from one walk: (matched length per worker,
    /// longest matched length, workers holding that length), as `match` and
    /// `longest_match` answer them, and the tokens as converted (`TokenIds`, for the
    /// decision's `insert`).
    fn lookup<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
    ) -> PyResult<LookupAnswer<'py>> {
        let (out, longest, holders, ids) = with_tree!(self, t => lookup_in(t, py, tokens)?);
        let d = PyDict::new(py);
        let mut names = Vec::with_capacity(holders);
        for (i, (id, handle, len)) in out.into_iter().enumerate() {
            let name = self.py_name(py, id, &handle);
            if i < holders {
                names.push(name.clone_ref(py));
            }
            d.set_item(name, len)?;
        }
        Ok((d, longest, names, Py::new(py, ids)?))
    }

    /// (longest matched length, workers holding that length).
    fn longest_match(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
    ) -> PyResult<(u32, Vec<Py<PyString>>)> {
        let (len, holders) = with_tree!(self, t => longest_in(t, py, &tokens_for(t, tokens)?));
        let names = holders
            .iter()
            .map(|(id, h)| self.py_name(py, *id, h))
            .collect();
        Ok((len, names))
    }

    /// Forget a worker and its cached prefixes (no-op if unknown).
    fn remove_worker(&self, py: Python<'_>, worker: &str) {
        with_tree!(self, t => py.detach(|| t.write().remove_worker(worker)));
    }

    /// Register a worker with nothing cached (no-op if known).
    fn add_worker(&self, worker: &str) {
        with_tree!(self, t => t.write().add_worker(worker));
    }

    /// Give `worker` its own budget (None: the index's); evicts down to it at once.
    #[pyo3(signature = (worker, max_tokens))]
    fn set_worker_budget(
        &self,
        py: Python<'_>,
        worker: &str,
        max_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        let budget = match max_tokens {
            None => None,
            Some(v) if v.is_none() => None,
            Some(v) => Some(budget_arg(v, "max_tokens")?),
        };
        Ok(with_tree!(self, t => py.detach(|| t.write().set_worker_budget(worker, budget))))
    }

    /// The budget that applies to `worker`: its own, else the index's (None: unbounded).
    fn worker_budget(&self, worker: &str) -> Option<u64> {
        with_tree!(self, t => t.read().worker_budget(worker))
    }

    /// Tokens the worker is predicted to hold (0 if unknown).
    fn cached_tokens(&self, worker: &str) -> u64 {
        with_tree!(self, t => t.read().cached_tokens(worker))
    }

    /// Known workers in registration order.
    fn workers(&self) -> Vec<String> {
        with_tree!(self, t => t.read().workers())
    }

    /// Forget every cached prefix; workers stay registered.
    fn clear(&self, py: Python<'_>) {
        with_tree!(self, t => py.detach(|| t.write().clear()));
    }

    /// Counters: nodes, stored_tokens, cached_tokens, memory_bytes, evicted_tokens.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = with_tree!(self, t => py.detach(|| t.read().stats()));
        let d = PyDict::new(py);
        d.set_item("nodes", s.nodes)?;
        d.set_item("stored_tokens", s.stored_tokens)?;
        d.set_item("cached_tokens", s.cached_tokens)?;
        d.set_item("memory_bytes", s.memory_bytes)?;
        d.set_item("evicted_tokens", s.evicted_tokens)?;
        Ok(d)
    }

    /// Raise AssertionError if an internal invariant is broken (for tests).
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        let r = py.detach(|| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(
                || with_tree!(self, t => t.read().check_invariants()),
            ))
        });
        r.map_err(|e| {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "invariant broken".into());
            pyo3::exceptions::PyAssertionError::new_err(msg)
        })
    }

    fn __repr__(&self) -> String {
        let (workers, s, budget) = with_tree!(self, t => {
            let g = t.read();
            (g.workers().len(), g.stats(), g.max_tokens_per_worker())
        });
        format!(
            "PrefixIndex(workers={}, nodes={}, cached_tokens={}, max_tokens_per_worker={}{})",
            workers,
            s.nodes,
            s.cached_tokens,
            budget.map_or_else(|| "None".to_string(), |b| b.to_string()),
            if self.byte_tokens() {
                ", byte_tokens=True"
            } else {
                ""
            }
        )
    }
}

/// `array.array('I', [0])`, repeated to size the arrays `u32_array` fills.
static ONE_ZERO_ID: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// An `array.array('I')` of `values`, filled in place (one allocation: `ONE_ZERO_ID`
/// repeated, then written through its buffer).
fn u32_array<'py>(
    py: Python<'py>,
    values: impl ExactSizeIterator<Item = u32>,
) -> PyResult<Bound<'py, PyAny>> {
    let len = values.len();
    let one = ONE_ZERO_ID.get_or_try_init(py, || -> PyResult<Py<PyAny>> {
        let array = py.import("array")?.getattr("array")?;
        Ok(array.call1(("I", vec![0u32]))?.unbind())
    })?;
    let out = one.bind(py).mul(len)?;
    if len == 0 {
        return Ok(out); // no storage to fill (nor an aligned pointer to it)
    }
    let buf = PyBuffer::<u32>::get(&out)?;
    let cells = buf
        .as_mut_slice(py)
        .ok_or_else(|| PyTypeError::new_err("array('I') is not a writable u32 buffer"))?;
    for (cell, v) in cells.iter().zip(values) {
        cell.set(v);
    }
    drop(buf);
    Ok(out)
}

/// The state store's tree keys for a prompt: two u32 per whole block of 16 tokens, the
/// block's 64-bit digest low half first (`crate::digests`), as an `array.array('I')`.
/// Equal to `kvroute.fleet.shared.digests.block_digests(tokens).view(uint32)`.
#[pyfunction]
fn block_digest_keys<'py>(
    py: Python<'py>,
    tokens: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    let tokens = extract_tokens(tokens)?;
    // About a nanosecond per token: shorter than releasing and taking back the GIL.
    let keys = crate::digests::block_digest_keys(&tokens);
    u32_array(py, keys.iter().copied())
}

pyo3::create_exception!(
    _native,
    UnknownParentError,
    pyo3::exceptions::PyLookupError,
    "A BlockStored event names a parent block the index does not know (an event was lost)."
);

/// Engine block hashes as u64: vLLM sends unsigned 64-bit ints, SGLang signed ones
/// (taken as their two's complement); bytes hashes are converted by the caller.
fn extract_hashes(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    let mut out = Vec::new();
    for (i, item) in obj.try_iter()?.enumerate() {
        out.push(hash_at(&item?, i)?);
    }
    Ok(out)
}

fn hash_at(item: &Bound<'_, PyAny>, i: usize) -> PyResult<u64> {
    if let Ok(v) = item.extract::<u64>() {
        return Ok(v);
    }
    if let Ok(v) = item.extract::<i64>() {
        return Ok(v as u64);
    }
    Err(PyValueError::new_err(format!(
        "block hash at position {i} must be an int in [-2**63, 2**64), got {}",
        item.repr().map(|r| r.to_string()).unwrap_or_default()
    )))
}

fn event_error(e: EventError) -> PyErr {
    match e {
        EventError::UnknownParent(h) => {
            UnknownParentError::new_err(format!("unknown parent block hash {h}"))
        }
        EventError::Malformed(m) => PyValueError::new_err(m),
    }
}

/// Block-level index of what each worker really caches, fed by KV events.
#[pyclass(name = "BlockIndex", module = "kvroute._native", frozen)]
pub struct PyBlockIndex {
    inner: RwLock<BlockIndex>,
}

#[pymethods]
impl PyBlockIndex {
    #[new]
    fn new() -> Self {
        PyBlockIndex {
            inner: RwLock::new(BlockIndex::new()),
        }
    }

    #[pyo3(signature = (worker, parent_hash, block_hashes, token_ids, block_size))]
    fn stored(
        &self,
        py: Python<'_>,
        worker: &str,
        parent_hash: Option<&Bound<'_, PyAny>>,
        block_hashes: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        block_size: usize,
    ) -> PyResult<()> {
        let parent = match parent_hash {
            Some(p) if !p.is_none() => Some(hash_at(p, 0)?),
            _ => None,
        };
        let hashes = extract_hashes(block_hashes)?;
        let tokens = extract_tokens(token_ids)?;
        py.detach(|| {
            self.inner
                .write()
                .stored(worker, parent, &hashes, &tokens, block_size)
        })
        .map_err(event_error)
    }

    fn removed(
        &self,
        py: Python<'_>,
        worker: &str,
        block_hashes: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let hashes = extract_hashes(block_hashes)?;
        Ok(py.detach(|| self.inner.write().removed(worker, &hashes)))
    }

    fn clear_worker(&self, py: Python<'_>, worker: &str) {
        py.detach(|| self.inner.write().clear_worker(worker));
    }

    fn remove_worker(&self, py: Python<'_>, worker: &str) {
        py.detach(|| self.inner.write().remove_worker(worker));
    }

    #[pyo3(name = "match")]
    fn match_<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let tokens = extract_tokens(tokens)?;
        let out = py.detach(|| self.inner.read().match_all(&tokens));
        let d = PyDict::new(py);
        for (name, len) in out {
            d.set_item(name, len)?;
        }
        Ok(d)
    }

    fn cached_tokens(&self, worker: &str) -> u64 {
        self.inner.read().cached_tokens(worker)
    }

    fn cached_blocks(&self, worker: &str) -> u64 {
        self.inner.read().cached_blocks(worker)
    }

    fn block_size(&self, worker: &str) -> Option<usize> {
        self.inner.read().block_size(worker)
    }

    fn workers(&self) -> Vec<String> {
        self.inner.read().workers()
    }

    fn distinct_blocks(&self) -> u64 {
        self.inner.read().distinct_blocks()
    }
}

#[pymodule]
#[pyo3(name = "_native")]
fn native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPrefixIndex>()?;
    m.add_class::<PyBlockIndex>()?;
    m.add_class::<PyTokenIds>()?;
    m.add_function(wrap_pyfunction!(block_digest_keys, m)?)?;
    m.add(
        "UnknownParentError",
        m.py().get_type::<UnknownParentError>(),
    )?;
    crate::python_bpe::add(m)?;
    crate::python_estimators::add(m)?;
    Ok(())
}
