//! The companion's Prometheus metrics, served as text on `GET /metrics`
//! (`llm_ratelimit_companion_*`, base units, counters ending in `_total`).
//!
//! Every labelled series is created here, at start, and held as a handle (an `Arc` of
//! atomics): counting on the request path is an atomic add, with no label lookup, no
//! lock and no allocation. Labels are fixed sets (ops, outcomes), never a tenant.

use crate::limits::Op;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Metric, Registry, Unit};
use std::time::Duration;

/// The ops of `_decisions_total` and `_redis_call_duration_seconds`: what the companion
/// was asked (`queue` is a charge that may wait). Redis calls also carry `touch` and
/// `reset`; `usage` is the script's peek.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricOp {
    Charge,
    Queue,
    Lease,
    Settle,
    Release,
    Touch,
    Usage,
    Reset,
    Calibration,
    Provider,
    Ledger,
    Spend,
}

impl MetricOp {
    const ALL: [MetricOp; 12] = [
        MetricOp::Charge,
        MetricOp::Queue,
        MetricOp::Lease,
        MetricOp::Settle,
        MetricOp::Release,
        MetricOp::Touch,
        MetricOp::Usage,
        MetricOp::Reset,
        MetricOp::Calibration,
        MetricOp::Provider,
        MetricOp::Ledger,
        MetricOp::Spend,
    ];

    fn label(self) -> &'static str {
        match self {
            MetricOp::Charge => "charge",
            MetricOp::Queue => "queue",
            MetricOp::Lease => "lease",
            MetricOp::Settle => "settle",
            MetricOp::Release => "release",
            MetricOp::Touch => "touch",
            MetricOp::Usage => "usage",
            MetricOp::Reset => "reset",
            MetricOp::Calibration => "calibration",
            MetricOp::Provider => "provider",
            MetricOp::Ledger => "ledger",
            MetricOp::Spend => "spend",
        }
    }

    /// The op whose script call this is.
    pub fn of_script(op: Op) -> MetricOp {
        match op {
            Op::Charge => MetricOp::Charge,
            Op::Lease => MetricOp::Lease,
            Op::Settle => MetricOp::Settle,
            Op::Touch => MetricOp::Touch,
            Op::Release => MetricOp::Release,
            Op::Peek => MetricOp::Usage,
            Op::Reset => MetricOp::Reset,
        }
    }
}

/// A decision's outcome: `allowed` (charged, granted, settled, answered with room),
/// `limited` (no room) or `error` (Redis failed or answered what it should not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Allowed,
    Limited,
    Error,
}

impl Outcome {
    const ALL: [Outcome; 3] = [Outcome::Allowed, Outcome::Limited, Outcome::Error];

    fn label(self) -> &'static str {
        match self {
            Outcome::Allowed => "allowed",
            Outcome::Limited => "limited",
            Outcome::Error => "error",
        }
    }
}

type Labels = [(&'static str, &'static str); 2];
type OpLabel = [(&'static str, &'static str); 1];

pub struct Metrics {
    registry: Registry,
    /// By `MetricOp` then `Outcome`, as listed in their `ALL`.
    decisions: Vec<[Counter; 3]>,
    /// By `MetricOp`.
    redis_call_duration: Vec<Histogram>,
    pub script_errors: Counter,
    pub noscript_reloads: Counter,
    /// Charges waiting in this companion's queue for capacity now.
    pub queue_depth: Gauge,
    pub queue_wait: Histogram,
    pub settlements_applied: Counter,
    pub settlements_dropped: Counter,
    pub auth_failures: Counter,
    pub admin_resets: Counter,
    /// Plans an admin set, deleted or imported (one per plan written).
    pub plan_changes: Counter,
    /// Readiness checks that found Redis refusing the companion's credentials.
    pub redis_auth_failures: Counter,
    /// Credits refused for having no reservation or grant behind them, and credits cut
    /// to what their reservation took.
    pub credits_unbacked: Counter,
    pub credits_capped: Counter,
}

/// Redis calls take tens of microseconds to tens of milliseconds (the timeout's range):
/// 25 µs to ~0.8 s in factors of 2.
fn redis_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.000_025, 2.0, 16))
}

/// Registers a handle on `metric` under `name` and gives the metric back to be kept.
fn registered<M: Metric + Clone>(registry: &mut Registry, name: &str, help: &str, unit: Option<Unit>, metric: M) -> M {
    match unit {
        Some(unit) => registry.register_with_unit(name, help, unit, metric.clone()),
        None => registry.register(name, help, metric.clone()),
    }
    metric
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("llm_ratelimit_companion");
        let r = &mut registry;
        let decisions = registered(
            r,
            "decisions",
            "Calls answered, by op and outcome (settle, release and touch: per entry)",
            None,
            Family::<Labels, Counter>::default(),
        );
        let redis_call_duration = registered(
            r,
            "redis_call_duration",
            "Time of the Redis call that carried each call (a batch: its one script call, for each call in it)",
            Some(Unit::Seconds),
            Family::<OpLabel, Histogram>::new_with_constructor(redis_buckets as fn() -> Histogram),
        );
        let settlements = registered(
            r,
            "settlements",
            "Settlements applied, or dropped because their reservation was gone (settled before, or expired)",
            None,
            Family::<OpLabel, Counter>::default(),
        );
        let credits = registered(
            r,
            "credits_refused",
            "Settlement credits refused: unbacked (no reservation record behind them), or capped (above what their reservation took)",
            None,
            Family::<OpLabel, Counter>::default(),
        );
        Metrics {
            decisions: MetricOp::ALL
                .iter()
                .map(|op| Outcome::ALL.map(|outcome| decisions.get_or_create_owned(&labels(*op, outcome))))
                .collect(),
            redis_call_duration: MetricOp::ALL
                .iter()
                .map(|op| redis_call_duration.get_or_create_owned(&[("op", op.label())]))
                .collect(),
            settlements_applied: settlements.get_or_create_owned(&[("outcome", "applied")]),
            settlements_dropped: settlements.get_or_create_owned(&[("outcome", "dropped")]),
            script_errors: registered(
                r,
                "script_errors",
                "Script calls Redis answered with an error (bad arguments, a refused command) or an unexpected reply",
                None,
                Counter::default(),
            ),
            noscript_reloads: registered(
                r,
                "noscript_reloads",
                "Times the script was missing in Redis (NOSCRIPT: a restart, SCRIPT FLUSH) and was loaded again",
                None,
                Counter::default(),
            ),
            queue_depth: registered(
                r,
                "queue_depth",
                "Charges waiting in this companion for capacity",
                None,
                Gauge::default(),
            ),
            queue_wait: registered(
                r,
                "queue_wait",
                "How long charges that waited for capacity waited, until admitted or refused",
                Some(Unit::Seconds),
                // A queued charge waits from a few milliseconds up to queue.max_wait (10 min).
                Histogram::new(exponential_buckets(0.005, 2.0, 18)),
            ),
            auth_failures: registered(
                r,
                "auth_failures",
                "Requests refused for a missing or wrong x-llmrl-token",
                None,
                Counter::default(),
            ),
            admin_resets: registered(
                r,
                "admin_resets",
                "Tenants whose counters an admin reset",
                None,
                Counter::default(),
            ),
            plan_changes: registered(
                r,
                "plan_changes",
                "Owners' plans an admin set, deleted or imported (one per plan written)",
                None,
                Counter::default(),
            ),
            redis_auth_failures: registered(
                r,
                "redis_auth_failures",
                "Readiness checks on which Redis refused the companion's credentials (WRONGPASS, NOAUTH, NOPERM)",
                None,
                Counter::default(),
            ),
            credits_unbacked: credits.get_or_create_owned(&[("outcome", "unbacked")]),
            credits_capped: credits.get_or_create_owned(&[("outcome", "capped")]),
            registry,
        }
    }

    pub fn decision(&self, op: MetricOp, outcome: Outcome) {
        let by_outcome = &self.decisions[op as usize];
        by_outcome[outcome as usize].inc();
    }

    pub fn redis_call(&self, op: MetricOp, took: Duration) {
        self.redis_call_duration[op as usize].observe(took.as_secs_f64());
    }

    /// The exposition, in the OpenMetrics text format Prometheus reads.
    pub fn render(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut text, &self.registry);
        text
    }
}

fn labels(op: MetricOp, outcome: Outcome) -> Labels {
    [("op", op.label()), ("outcome", outcome.label())]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_series_is_there_from_the_start_with_the_agreed_names() {
        let metrics = Metrics::new();
        metrics.decision(MetricOp::Charge, Outcome::Limited);
        metrics.decision(MetricOp::Charge, Outcome::Limited);
        metrics.redis_call(MetricOp::Settle, Duration::from_micros(120));
        metrics.settlements_dropped.inc();
        let text = metrics.render();
        for line in [
            r#"llm_ratelimit_companion_decisions_total{op="charge",outcome="limited"} 2"#,
            r#"llm_ratelimit_companion_decisions_total{op="queue",outcome="error"} 0"#,
            r#"llm_ratelimit_companion_redis_call_duration_seconds_count{op="settle"} 1"#,
            r#"llm_ratelimit_companion_redis_call_duration_seconds_bucket{le="0.0002",op="settle"} 1"#,
            r#"llm_ratelimit_companion_redis_call_duration_seconds_bucket{le="0.0001",op="settle"} 0"#,
            "llm_ratelimit_companion_script_errors_total 0",
            "llm_ratelimit_companion_noscript_reloads_total 0",
            "llm_ratelimit_companion_queue_depth 0",
            "llm_ratelimit_companion_queue_wait_seconds_count 0",
            r#"llm_ratelimit_companion_settlements_total{outcome="dropped"} 1"#,
            r#"llm_ratelimit_companion_settlements_total{outcome="applied"} 0"#,
            "llm_ratelimit_companion_auth_failures_total 0",
            "llm_ratelimit_companion_admin_resets_total 0",
            "llm_ratelimit_companion_plan_changes_total 0",
            "# TYPE llm_ratelimit_companion_redis_call_duration_seconds histogram",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing from\n{text}");
        }
    }
}
