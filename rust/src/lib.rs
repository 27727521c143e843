//! kvroute's native core: prefix indexes over token IDs for cache-aware routing.
//!
//! The core modules are plain Rust (no PyO3) so that `cargo test` and the criterion
//! benches run without Python; the binding lives in `python` behind the `python` feature.

pub mod blocks;
pub mod children;
pub mod digests;
// The work model's robust line fit (kvroute.routing.load), on the request path per answer.
pub mod estimators;
pub mod lru;
pub mod tree;

#[cfg(feature = "python")]
mod python;
#[cfg(feature = "python")]
mod python_estimators;

pub use blocks::{BlockIndex, EventError};
pub use tree::{ByteIndex, IndexStats, Lookup, PrefixIndex, Symbol, Tree, Walk};

// Exact byte-level BPE (tokenization for routing); kept apart from the index modules.
pub mod bpe;
#[cfg(feature = "python")]
mod python_bpe;
