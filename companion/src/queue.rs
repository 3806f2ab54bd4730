//! Waiting for capacity instead of refusing at once. A charge that may wait is retried
//! here as capacity comes back (tokens refill, slots are released), for up to its
//! `max_ms`. Waiters of a tenant queue in a Redis sorted set shared by every companion,
//! scored by `enqueued_ms - priority x aging_ms`: only the head may take capacity, so
//! higher priorities go first, and a low priority request moves up as it waits (each
//! priority level is worth `aging_ms` of waiting), so it is never starved. The limits
//! themselves are still enforced by the script (`lua/limits.lua`) alone.
//!
//! A waiter whose client gives up is dropped with its HTTP request: its entry is removed
//! then, and any entry left by a crashed companion is ignored once its deadline passed
//! (the deadline is part of the member).
//!
//! Waiters do not each poll Redis: this companion keeps its own waiters of each tenant in
//! a line in the same order (`Lines`), and only the first of a line looks at Redis (is it
//! the head, and is there room). The others sleep until the line changes (someone ahead
//! left) or their time is up. So a tenant with a thousand waiters costs each companion
//! one poll at a time, as a tenant with one does.

use crate::batcher::Batcher;
use crate::metrics::{MetricOp, Metrics};
use crate::store::Store;
use llm_ratelimit_protocol::keys::{redis_key, QUEUE_KIND, QUEUE_NAME};
use llm_ratelimit_protocol::{ChargeRequest, LimitStatus, LimitsReply, Wait};
use redis::Value;
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::Notify;

/// How often a waiter looks again when capacity should come back later than that: slots
/// are released at unpredictable times.
const POLL: Duration = Duration::from_millis(20);

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// A place in a line: the waiter's score (as in Redis, whole ms) and its member.
type Place = (i64, String);

/// This companion's waiters, a line per tenant queue (its Redis key), each in the Redis
/// order. A line lives while it has waiters.
#[derive(Default)]
pub struct Lines {
    lines: Mutex<HashMap<String, Arc<Line>>>,
}

#[derive(Default)]
struct Line {
    places: Mutex<BTreeSet<Place>>,
    /// Woken whenever a waiter leaves: the next one may now be first.
    changed: Notify,
}

impl Lines {
    fn join(&self, key: &str, place: Place) -> Arc<Line> {
        let mut lines = self.lines.lock().unwrap_or_else(|e| e.into_inner());
        let line = lines.entry(key.to_string()).or_default().clone();
        line.places.lock().unwrap_or_else(|e| e.into_inner()).insert(place);
        line
    }

    fn leave(&self, key: &str, place: &Place) {
        let mut lines = self.lines.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(line) = lines.get(key).cloned() {
            let mut places = line.places.lock().unwrap_or_else(|e| e.into_inner());
            places.remove(place);
            if places.is_empty() {
                lines.remove(key);
            }
            drop(places);
            line.changed.notify_waiters();
        }
    }
}

impl Line {
    fn is_first(&self, place: &Place) -> bool {
        self.places.lock().unwrap_or_else(|e| e.into_inner()).first() == Some(place)
    }
}

/// Removes the waiter's entry when the wait ends, however it ends (also when the client
/// gave up and the request future is dropped), and counts it out of the queue's depth.
struct Waiter {
    store: Store,
    key: String,
    place: Place,
    line: Arc<Line>,
    lines: Arc<Lines>,
    metrics: Arc<Metrics>,
}

impl Drop for Waiter {
    fn drop(&mut self) {
        self.metrics.queue_depth.dec();
        self.lines.leave(&self.key, &self.place);
        let (store, key, member) =
            (self.store.clone(), std::mem::take(&mut self.key), std::mem::take(&mut self.place.1));
        tokio::spawn(async move {
            let _ = store.query(redis::cmd("ZREM").arg(&key).arg(&member)).await;
        });
    }
}

/// A queue's own Redis command (not a script call), timed as op `queue`.
async fn query(store: &Store, metrics: &Metrics, cmd: &redis::Cmd) -> Result<Value, String> {
    let started = Instant::now();
    let result = store.query(cmd).await.map_err(|e| e.to_string());
    metrics.redis_call(MetricOp::Queue, started.elapsed());
    result
}

/// Whether `member` is first among the waiters still within their deadline.
async fn is_head(store: &Store, metrics: &Metrics, key: &str, member: &str) -> Result<bool, String> {
    let value = query(store, metrics, redis::cmd("ZRANGE").arg(key).arg(0).arg(63)).await?;
    let Value::Array(members) = value else { return Ok(true) };
    let now = now_ms();
    for entry in members {
        let Value::BulkString(bytes) = entry else { continue };
        let text = String::from_utf8_lossy(&bytes).into_owned();
        let deadline = text.split_once(':').and_then(|(d, _)| d.parse::<u64>().ok()).unwrap_or(0);
        if deadline < now {
            let _ = store.query(redis::cmd("ZREM").arg(key).arg(&text)).await;
            continue;
        }
        return Ok(text == member);
    }
    Ok(true)
}

/// Whether no wait within `left` can admit the request: its owner is suspended, a limit
/// can never admit it, or a
/// limit that refused it needs longer than that. A provisional limit (tokens and cost,
/// reserved at an estimate) is not judged by its retry time: that assumes nothing comes
/// back, while requests in flight settle below their estimates and return capacity at
/// any moment, so its waiter looks again until its time is up.
fn is_hopeless(request: &ChargeRequest, reply: &LimitsReply, left: Duration) -> bool {
    reply.suspended.is_some()
        || reply.limits.iter().any(|outcome| match outcome.status {
            LimitStatus::Allowed => false,
            LimitStatus::Never => true,
            LimitStatus::Limited => {
                let provisional = request.limits.iter().any(|l| l.name == outcome.name && l.provisional);
                !provisional && Duration::from_millis(outcome.retry_after_ms) > left
            }
        })
}

/// One try, with the request's cancel marker (split by owner on a cluster, see `pools`).
async fn charge(batcher: &Arc<Batcher>, prefix: &str, request: &ChargeRequest) -> Result<LimitsReply, String> {
    crate::pools::charge(batcher, prefix, request).await
}

/// The answer of a waiter whose time ran out before it was first: the refusal it had.
fn out_of_time(metrics: &Metrics, last: Option<LimitsReply>, waited: Duration) -> Result<LimitsReply, String> {
    metrics.queue_wait.observe(waited.as_secs_f64());
    last.map(|mut r| {
        r.waited_ms = waited.as_millis() as u64;
        r
    })
    .ok_or_else(|| "no answer".to_string())
}

/// Charges, waiting in the tenant's queue for up to `wait.max_ms` if there is no room yet.
pub async fn charge_waiting(
    batcher: &Arc<Batcher>,
    metrics: &Arc<Metrics>,
    lines: &Arc<Lines>,
    prefix: &str,
    request: &ChargeRequest,
    wait: &Wait,
) -> Result<LimitsReply, String> {
    let store = batcher.store();
    let id = request.reservation.as_ref().map_or("", |r| r.id.as_str());
    let started = Instant::now();
    let max = Duration::from_millis(wait.max_ms);
    let key = redis_key(prefix, &request.domain, &request.tenant, QUEUE_KIND, QUEUE_NAME);
    let enqueued = now_ms();
    let member = format!("{}:{id}", enqueued + wait.max_ms);
    let score = enqueued as i64 - i64::from(wait.priority) * wait.aging_ms as i64;
    let mut waiter: Option<Waiter> = None;
    let mut last: Option<LimitsReply> = None;
    loop {
        let waited = started.elapsed();
        // Armed before looking, so a change while this waiter looks is not missed.
        let changed = waiter.as_ref().map(|w| w.line.clone());
        let changed = changed.as_ref().map(|line| line.changed.notified());
        let mut changed = std::pin::pin!(changed);
        if let Some(notified) = changed.as_mut().as_pin_mut() {
            notified.enable();
        }
        let first_here = waiter.as_ref().is_none_or(|w| w.line.is_first(&w.place));
        if waiter.is_some() && !first_here {
            // Someone of this companion is ahead: it polls; this one waits for it to leave.
            if waited >= max {
                return out_of_time(metrics, last, waited);
            }
            if let Some(notified) = changed.as_mut().as_pin_mut() {
                let _ = tokio::time::timeout(max - waited, notified).await;
            }
            continue;
        }
        if waiter.is_none() || is_head(store, metrics, &key, &member).await? {
            let mut reply = charge(batcher, prefix, request).await?;
            reply.waited_ms = waited.as_millis() as u64;
            let retry = reply.limits.iter().map(|l| l.retry_after_ms).max().unwrap_or(0);
            if reply.allowed || waited >= max || is_hopeless(request, &reply, max - waited) {
                if waiter.is_some() {
                    metrics.queue_wait.observe(waited.as_secs_f64());
                }
                return Ok(reply);
            }
            if waiter.is_none() {
                query(store, metrics, redis::cmd("ZADD").arg(&key).arg(score).arg(&member)).await?;
                let _ = query(store, metrics, redis::cmd("PEXPIRE").arg(&key).arg(wait.max_ms + 1000)).await;
                metrics.queue_depth.inc();
                let place = (score, member.clone());
                let line = lines.join(&key, place.clone());
                waiter = Some(Waiter {
                    store: store.clone(),
                    key: key.clone(),
                    place,
                    line,
                    lines: lines.clone(),
                    metrics: metrics.clone(),
                });
            }
            last = Some(reply);
            tokio::time::sleep(Duration::from_millis(retry).clamp(Duration::from_millis(2), POLL)).await;
        } else {
            if waited >= max {
                return out_of_time(metrics, last, waited);
            }
            tokio::time::sleep(POLL).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use llm_ratelimit_protocol::{LimitCharge, LimitKind, LimitOutcome};

    fn limit(name: &str, provisional: bool) -> LimitCharge {
        LimitCharge {
            owner: None,
            shadow: false,
            name: name.into(),
            capacity: 1_000,
            window_ms: 60_000,
            cost: 100,
            min_cost: None,
            kind: LimitKind::SlidingWindow,
            period_bounds_ms: Vec::new(),
            provisional,
            look_only: false,
            fair: None,
        }
    }

    fn outcome(name: &str, status: LimitStatus, retry_after_ms: u64) -> LimitOutcome {
        LimitOutcome {
            name: name.into(),
            status,
            limit: 1_000,
            remaining: 0,
            reset_after_ms: 60_000,
            retry_after_ms,
            charged: 0,
        }
    }

    fn judged(outcomes: Vec<LimitOutcome>, left_ms: u64) -> bool {
        let request = ChargeRequest {
            domain: "llm".into(),
            tenant: "t".into(),
            limits: vec![limit("rpm", false), limit("tpm", true)],
            reservation: None,
            wait: None,
        };
        let reply = LimitsReply { allowed: false, limits: outcomes, waited_ms: 0, suspended: None };
        is_hopeless(&request, &reply, Duration::from_millis(left_ms))
    }

    #[test]
    fn a_token_reservation_is_waited_for_whatever_its_retry_time() {
        // Settlements below their estimates give tokens back before the window says.
        assert!(!judged(
            vec![outcome("rpm", LimitStatus::Allowed, 0), outcome("tpm", LimitStatus::Limited, 59_000)],
            2_000
        ));
    }

    #[test]
    fn a_request_limit_beyond_the_wait_is_hopeless_at_once() {
        assert!(judged(
            vec![outcome("rpm", LimitStatus::Limited, 30_000), outcome("tpm", LimitStatus::Allowed, 0)],
            2_000
        ));
        assert!(!judged(
            vec![outcome("rpm", LimitStatus::Limited, 1_500), outcome("tpm", LimitStatus::Allowed, 0)],
            2_000
        ));
    }

    #[test]
    fn a_cost_that_never_fits_is_hopeless_even_if_provisional() {
        assert!(judged(vec![outcome("rpm", LimitStatus::Allowed, 0), outcome("tpm", LimitStatus::Never, 0)], 2_000));
    }
}
