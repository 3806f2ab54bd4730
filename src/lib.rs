//! llm-ratelimit: distributed, token-aware rate limiting for LLM APIs, as a proxy-wasm
//! HTTP filter.
//!
//! Everything but `filter` is plain Rust with no proxy-wasm types, unit tested natively;
//! `filter` is the thin glue to the proxy-wasm host and exists only in the wasm build.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing))]

pub mod breaker;
pub mod bucket;
pub mod charge;
pub mod config;
pub mod decision;
pub mod duration;
pub mod identity;
mod json;
pub mod lease;
pub mod protocol;
pub mod request;
pub mod reservation;
pub mod settle_queue;
pub mod sse;
pub mod tokens;
pub mod usage;

// The glue imports host functions that a wasm test runner (Node) does not provide.
#[cfg(all(target_arch = "wasm32", not(test)))]
mod filter;
