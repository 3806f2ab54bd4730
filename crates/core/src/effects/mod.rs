//! Effects over the `Host`: the host trait itself, the bounded per-tenant tables in shared
//! data, where the calibrations are kept, and the settlements queued for the companion.

pub mod calibration_store;
pub mod host;
pub mod settle_queue;
pub mod tables;
