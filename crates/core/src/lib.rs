//! llm-ratelimit's core: everything the filter judges, as plain Rust with no proxy-wasm
//! types, unit tested natively (and as wasm under Node). The cdylib in the repository's
//! top-level `src/` only maps proxy-wasm callbacks onto it.
//!
//! One folder per layer, drawn top to bottom. A module imports only from its own layer
//! and the layers below it: `scripts/check_layers.py` (run by `make lint`) reads the order
//! from this drawing and fails on an import upward or a cycle. Only `effects`, `worker`
//! and `lifecycle` take a `Host`.
//!
//! ```text
//! lifecycle     a request's life over the Host: admit, forward, settle (the RequestFilter)
//! worker        per-VM state and background work: leases, settlements, calibration
//!                 exchange, the breaker (never a RequestFilter)
//! effects       the Host trait (host); bounded tenant tables in shared data (tables);
//!                 where calibrations are kept (calibration_store); the settle queue;
//!                 the local limiter: exact counters in shared data, for the local store
//!                 and the degraded mode (local_limiter)
//!                 the provider's word on its limits, read from a reply (provider_word)
//!                 and kept (provider_state); the pace of the exchanges with the
//!                 companion (exchange)
//! replies       what the client is told, in its API's shape: reply, answers, decision
//! plan          what the policy makes of a request: the charge plan (charge), the
//!                 metric series (series), its settlement (settlement)
//! config        the config, checked and compiled to policy
//! accounting    pure limiter math: bucket, calendar, counters (the script's limit kinds),
//!                 lease, breaker, reservation, reply_floor, calibration (the figures)
//! readers       a request body (request); a reply's usage (usage: JSON, SSE, JSON
//!                 array, AWS event stream)
//! providers     one leaf module per provider (openai, anthropic, gemini, azure,
//!                 bedrock): its paths, body shapes, usage and stream shapes, error
//!                 envelope, rate-limit header names, credential; their registration,
//!                 and the one Route a path is read into (mod.rs)
//! api           the shared vocabulary: Api, ReportedUsage, text of a JSON value; the
//!                 message-counting formula (prompt); why the filter refuses (refusal);
//!                 whose error shape answers (dialect); who a tenant is (identity)
//! tokens        tokenization; token counts remembered per VM (prompt_cache)
//! parse         base parsers: json, sse, eventstream, json_array_stream, path
//! ```
//!
//! `testing` (tests and the `testing` feature only) is the fake host; it may use anything.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing))]

pub mod accounting;
pub mod api;
pub mod config;
pub mod effects;
pub mod lifecycle;
pub mod parse;
pub mod plan;
pub mod providers;
pub mod readers;
pub mod replies;
pub mod tokens;
pub mod worker;

/// A fake host for lifecycle tests: records host calls, plays each host's semantics.
#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use llm_ratelimit_protocol as protocol;
pub use llm_ratelimit_protocol::duration;
