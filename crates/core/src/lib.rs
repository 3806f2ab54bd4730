//! llm-ratelimit's core: everything the filter judges, as plain Rust with no proxy-wasm
//! types, unit tested natively (and as wasm under Node). The cdylib in `crates/filter`
//! only maps proxy-wasm callbacks onto it.
//!
//! The modules in layers, each importing only from the layers below it
//! (`scripts/check_layers.py`, run by `make lint` and `make test`, fails on an import
//! cycle):
//!
//! ```text
//! worker                          per-VM state, background work (never a RequestFilter)
//! lifecycle                       a request's life over the Host: admit, forward, settle
//! calibration, tables, series     effects over the Host (shared data, metrics)
//! host                            the Host trait, the timer period
//! decision -> answers             what the client is told, in its API's shape
//! reply                           a local reply and its headers
//! pools                           whose counter each limit is charged on (`per`)
//! charge, reservation, bucket,    pure accounting: plan, estimate, settle, buckets,
//!   lease, breaker, settle_queue    leases, the breaker
//! config, identity                the config compiled to policy; who a tenant is
//! request, usage                  readers: a request body, a reply's usage (JSON, SSE,
//!                                   JSON array, AWS event stream)
//! providers::{gemini, azure,      each provider's paths, body and usage shapes; the one
//!   bedrock}, providers             Route a path is read into
//! api, dialect                    the shared vocabulary: Api, ReportedUsage, text of a
//!                                   JSON value; whose error shape answers
//! path, json, json_array_stream,  base parsers
//!   sse, eventstream, tokens,
//!   prompt_cache
//! testing                         the fake host (tests only)
//! ```
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing))]

pub mod answers;
pub mod api;
pub mod breaker;
pub mod bucket;
pub mod calibration;
pub mod charge;
pub mod config;
pub mod decision;
pub mod dialect;
pub mod eventstream;
pub mod host;
pub mod identity;
mod json;
pub mod json_array_stream;
pub mod lease;
pub mod lifecycle;
pub mod path;
pub mod pools;
pub mod prompt_cache;
pub mod providers;
pub mod reply;
pub mod reply_floor;
pub mod request;
pub mod reservation;
pub mod series;
pub mod settle_queue;
pub mod sse;
pub mod tables;
pub mod tokens;
pub mod usage;
pub mod worker;

/// A fake host for lifecycle tests: records host calls, plays each host's semantics.
#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use llm_ratelimit_protocol as protocol;
pub use llm_ratelimit_protocol::duration;
