//! Effects over the `Host`: the host trait itself, the bounded per-tenant tables in shared
//! data (and the lease table across a request's owners), where the completion averages and
//! the calibrations are kept, and the settlements queued for the companion.

pub mod average_store;
pub mod calibration_store;
pub mod exchange;
pub mod host;
pub mod lease_table;
pub mod local_limiter;
pub mod provider_state;
pub mod provider_word;
pub mod settle_queue;
pub mod tables;
