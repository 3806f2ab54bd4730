//! Pure accounting, no host and no config: token buckets, fair shares of a pool, calendar periods (a calendar
//! budget's window, in a time zone), leases, the breaker, the
//! reservation and its correction, the least a reply is charged, and the calibration
//! figures. The config is compiled from some of these types, so it sits above them.

pub mod breaker;
pub mod bucket;
pub mod calendar;
pub mod calibration;
pub mod counters;
pub mod fair_share;
pub mod lease;
pub mod ledger;
pub mod owner_plans;
pub mod reply_floor;
pub mod reservation;
