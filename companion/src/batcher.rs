//! Script calls coalesced into batches: every call of `lua/limits.lua` (charges, leases,
//! settlements, touches, releases) goes through here. A lane (the one server, or one hash
//! slot of a cluster, since a script's keys must share a slot) runs one script call at a
//! time; the calls that arrive meanwhile wait and go together in its next call, in the
//! script's batch form, up to `MAX_CALLS` in one. An idle lane sends a call at once and
//! alone, so an unloaded companion adds nothing; under load, Redis runs one script call
//! for many requests instead of one each, and the settlements a proxy sends in bulk ride
//! along with the charges. Inside the script each call is still its own: a charge all or
//! nothing, a settlement applied at most once by its reservation record.
//!
//! Decisions (charges and leases, a request waiting on each) go before adjustments
//! (settlements, touches, releases) into the next batch: a backlog of settlements flushed
//! after an outage delays a charge by one batch at most, not by the whole backlog.

use crate::limits::{self, Call};
use crate::metrics::{MetricOp, Metrics};
use crate::store::{Lane, Script, Store};
use redis::{ErrorKind, RedisError, ServerErrorKind, Value};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, Semaphore};

/// Most calls in one script call. Redis runs nothing else while a script runs: this bounds
/// that to about a millisecond (a call costs some microseconds in Lua).
pub const MAX_CALLS: usize = 100;

/// Script calls in flight at once across the lanes of a cluster (one server has one lane,
/// so one call). A backlog flushed after an outage (every proxy's settlements at once)
/// otherwise queues on the cluster connections, and the calls at the back time out
/// although most of them run: a timed-out settlement reported `failed` is sent again, and
/// one without a reservation is then applied twice. Waiting here, a call's Redis timeout
/// starts when it is sent.
const CALLS_IN_FLIGHT: usize = 16;

type Outcome = Result<Value, String>;

struct Waiting {
    call: Call,
    since: Instant,
    reply: oneshot::Sender<Outcome>,
}

/// The calls waiting in a busy lane for its next script call.
#[derive(Default)]
struct Queued {
    decisions: VecDeque<Waiting>,
    adjustments: VecDeque<Waiting>,
}

impl Queued {
    fn is_empty(&self) -> bool {
        self.decisions.is_empty() && self.adjustments.is_empty()
    }

    /// The next batch, decisions first, then adjustments, `MAX_CALLS` at most; and the
    /// decisions that waited `timeout` or longer, which are not to be sent.
    fn next_batch(&mut self, timeout: Duration) -> (Vec<Waiting>, Vec<Waiting>) {
        let (mut batch, mut stale) = (Vec::new(), Vec::new());
        while batch.len() < MAX_CALLS {
            let Some(waiting) = self.decisions.pop_front() else { break };
            if waiting.since.elapsed() >= timeout {
                stale.push(waiting);
            } else {
                batch.push(waiting);
            }
        }
        let adjustments = self.adjustments.len().min(MAX_CALLS - batch.len());
        batch.extend(self.adjustments.drain(..adjustments));
        (batch, stale)
    }
}

/// Whether a call decides a request (a charge or a lease) or adjusts what was decided.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Decision,
    Adjustment,
}

pub struct Batcher {
    store: Store,
    script: Script,
    /// The busy lanes (a script call out), with the calls waiting for the next: whoever
    /// made a lane busy sends its calls until none waits, and removes it. So this holds at
    /// most one entry per script call in flight.
    lanes: Mutex<HashMap<Lane, Queued>>,
    in_flight: Semaphore,
    /// A decision that waited this long for its lane fails without being sent: Redis is
    /// slow or away, and the request's own deadline has passed by then. (Adjustments wait
    /// as long as it takes: their callers wait a second or more, and send them again.)
    timeout: Duration,
    metrics: Arc<Metrics>,
}

impl Batcher {
    pub fn new(store: Store, script: Script, timeout: Duration, metrics: Arc<Metrics>) -> Arc<Batcher> {
        Arc::new(Batcher {
            store,
            script,
            lanes: Mutex::new(HashMap::new()),
            in_flight: Semaphore::new(CALLS_IN_FLIGHT),
            timeout,
            metrics,
        })
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Runs a charge or a lease: its reply, or what failed.
    pub async fn decide(self: &Arc<Self>, call: Call) -> Outcome {
        self.run(vec![call], Kind::Decision).await.pop().unwrap_or_else(|| Err("no reply".into()))
    }

    /// Runs settlements, touches or releases (of any tenants), each on its own: their
    /// replies, in order.
    pub async fn adjust(self: &Arc<Self>, calls: Vec<Call>) -> Vec<Outcome> {
        self.run(calls, Kind::Adjustment).await
    }

    /// Runs calls, batched with whatever else waits in their lanes: their replies, in order.
    async fn run(self: &Arc<Self>, calls: Vec<Call>, kind: Kind) -> Vec<Outcome> {
        if let Some(lane) = self.take_idle_lane(&calls) {
            // Nothing else waits: send them from here, sparing a hand-over to a drainer.
            let _busy = Busy { batcher: self, lane };
            let calls: Vec<&Call> = calls.iter().collect();
            return self.send(&calls).await;
        }
        let mut replies = Vec::with_capacity(calls.len());
        let mut idle = Vec::new();
        {
            let mut lanes = self.lanes();
            let since = Instant::now();
            for call in calls {
                let lane = self.store.lane(first_key(&call));
                let (reply, replied) = oneshot::channel();
                replies.push(replied);
                if !lanes.contains_key(&lane) {
                    idle.push(lane);
                }
                let queued = lanes.entry(lane).or_default();
                let queue = if kind == Kind::Decision { &mut queued.decisions } else { &mut queued.adjustments };
                queue.push_back(Waiting { call, since, reply });
            }
        }
        for lane in idle {
            let batcher = self.clone();
            tokio::spawn(async move { batcher.drain(lane).await });
        }
        let mut outcomes = Vec::with_capacity(replies.len());
        for replied in replies {
            outcomes.push(replied.await.unwrap_or_else(|_| Err("the batch was dropped".into())));
        }
        outcomes
    }

    /// The lane of `calls`, marked busy, if they fit one script call, share one lane, and
    /// that lane is idle.
    fn take_idle_lane(&self, calls: &[Call]) -> Option<Lane> {
        let (first, rest) = calls.split_first()?;
        let lane = self.store.lane(first_key(first));
        if calls.len() > MAX_CALLS || rest.iter().any(|call| self.store.lane(first_key(call)) != lane) {
            return None;
        }
        let mut lanes = self.lanes();
        if lanes.contains_key(&lane) {
            return None;
        }
        lanes.insert(lane, Queued::default());
        Some(lane)
    }

    fn lanes(&self) -> std::sync::MutexGuard<'_, HashMap<Lane, Queued>> {
        self.lanes.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Sends the lane's waiting calls, a batch at a time, until none is left.
    async fn drain(&self, lane: Lane) {
        loop {
            let (batch, stale) = {
                let mut lanes = self.lanes();
                let Some(queued) = lanes.get_mut(&lane) else { return };
                if queued.is_empty() {
                    lanes.remove(&lane);
                    return;
                }
                queued.next_batch(self.timeout)
            };
            for waiting in stale {
                let _ = waiting.reply.send(Err(format!("Redis did not take the call within {:?}", self.timeout)));
            }
            if batch.is_empty() {
                continue;
            }
            let calls: Vec<&Call> = batch.iter().map(|waiting| &waiting.call).collect();
            let outcomes = self.send(&calls).await;
            for (waiting, outcome) in batch.into_iter().zip(outcomes) {
                let _ = waiting.reply.send(outcome);
            }
        }
    }

    /// One script call for `calls` (of one lane): a single call as it is, several in the
    /// batch form.
    async fn send(&self, calls: &[&Call]) -> Vec<Outcome> {
        let Ok(_permit) = self.in_flight.acquire().await else {
            return vec![Err("shutting down".into()); calls.len()];
        };
        let started = Instant::now();
        let outcomes = if let [only] = calls {
            let result = self.store.run(&self.script, &only.keys, &[&only.argument]).await;
            if result.as_ref().is_err_and(is_script_error) {
                self.metrics.script_errors.inc();
            }
            vec![result.map_err(|err| err.to_string())]
        } else {
            self.send_batch(calls).await
        };
        let took = started.elapsed();
        for call in calls {
            self.metrics.redis_call(MetricOp::of_script(call.op), took);
        }
        outcomes
    }

    async fn send_batch(&self, calls: &[&Call]) -> Vec<Outcome> {
        let (keys, argument) = limits::batch(calls.iter().copied());
        let value = match self.store.run(&self.script, &keys, &[&argument]).await {
            Ok(value) => value,
            Err(err) => {
                if is_script_error(&err) {
                    self.metrics.script_errors.inc();
                }
                return vec![Err(err.to_string()); calls.len()];
            }
        };
        match limits::batch_replies(&value, calls.len()) {
            Ok(replies) => replies
                .into_iter()
                .map(|reply| {
                    if reply.as_ref().is_err_and(|err| !err.starts_with(CANCELLED)) {
                        self.metrics.script_errors.inc();
                    }
                    reply.cloned()
                })
                .collect(),
            Err(err) => {
                self.metrics.script_errors.inc();
                vec![Err(format!("unexpected batch reply: {err}")); calls.len()]
            }
        }
    }
}

/// The error a charge gets when its request was given up before it ran (see the
/// script): expected, not a script error.
const CANCELLED: &str = "CANCELLED";

/// Whether Redis answered the script call with an error of the script's own (bad
/// arguments, a command it refused), not a failure to reach Redis or a cancelled charge.
fn is_script_error(err: &RedisError) -> bool {
    matches!(err.kind(), ErrorKind::Server(ServerErrorKind::ResponseError) | ErrorKind::Extension)
        && err.code() != Some(CANCELLED)
}

fn first_key(call: &Call) -> &str {
    call.keys.first().map_or("", String::as_str)
}

/// A lane whose script call is sent by a caller itself. When the call is done, or the
/// caller's future is dropped mid-call (its client went away), the lane is handed to a
/// drainer if calls arrived meanwhile, and is idle again otherwise.
struct Busy<'a> {
    batcher: &'a Arc<Batcher>,
    lane: Lane,
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        let mut lanes = self.batcher.lanes();
        let runtime = tokio::runtime::Handle::try_current();
        match runtime {
            Ok(runtime) if lanes.get(&self.lane).is_some_and(|queued| !queued.is_empty()) => {
                let (batcher, lane) = (self.batcher.clone(), self.lane);
                runtime.spawn(async move { batcher.drain(lane).await });
            }
            _ => {
                lanes.remove(&self.lane);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waiting(name: &str, age: Duration) -> Waiting {
        let since = Instant::now().checked_sub(age).unwrap_or_else(Instant::now);
        let call = Call { op: limits::Op::Charge, keys: vec![name.to_string()], argument: String::new(), plans: 0 };
        Waiting { call, since, reply: oneshot::channel().0 }
    }

    fn names(batch: &[Waiting]) -> Vec<&str> {
        batch.iter().map(|w| first_key(&w.call)).collect()
    }

    #[test]
    fn decisions_go_first_and_a_stale_decision_is_not_sent() {
        let timeout = Duration::from_secs(10);
        let mut queued = Queued::default();
        for name in ["settle-1", "settle-2"] {
            queued.adjustments.push_back(waiting(name, timeout * 2)); // adjustments never go stale
        }
        queued.decisions.push_back(waiting("charge-late", timeout * 2));
        queued.decisions.push_back(waiting("charge", Duration::ZERO));
        let (batch, stale) = queued.next_batch(timeout);
        assert_eq!(names(&batch), ["charge", "settle-1", "settle-2"]);
        assert_eq!(names(&stale), ["charge-late"]);
        assert!(queued.is_empty());
    }

    #[test]
    fn a_batch_holds_at_most_max_calls_and_the_rest_waits_in_order() {
        let mut queued = Queued::default();
        for i in 0..150 {
            queued.adjustments.push_back(waiting(&format!("settle-{i}"), Duration::ZERO));
        }
        for i in 0..60 {
            queued.decisions.push_back(waiting(&format!("charge-{i}"), Duration::ZERO));
        }
        let (first, _) = queued.next_batch(Duration::from_secs(1));
        assert_eq!(first.len(), MAX_CALLS);
        assert_eq!(names(&first)[59..61], ["charge-59", "settle-0"]);
        let (second, _) = queued.next_batch(Duration::from_secs(1));
        assert_eq!(names(&second)[0], "settle-40");
        assert_eq!(second.len(), MAX_CALLS);
        let (third, _) = queued.next_batch(Duration::from_secs(1));
        assert_eq!(third.len(), 10);
        assert!(queued.is_empty());
    }
}
