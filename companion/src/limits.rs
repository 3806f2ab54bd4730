//! The translation between the JSON endpoints and `lua/limits.lua`: the KEYS and the
//! one JSON argument (named fields, see the script's header) of a charge, a lease, a
//! settlement, a touch, a release, a peek or a reset, and the script's reply back to JSON.

use llm_ratelimit_protocol::keys::{redis_key as key, CANCEL_KIND, ONCE_KIND, RESERVATION_KIND};
use llm_ratelimit_protocol::plans::{PLAN_KIND, PLAN_NAME};
use llm_ratelimit_protocol::{
    ChargeRequest, FairClaim, LeaseRequest, LimitKind, LimitOutcome, LimitStatus, LimitUsage, LimitsReply, Settlement,
    Suspension, TenantLimits, UsageReply,
};
use redis::Value;
use serde::Serialize;

pub const SOURCE: &str = include_str!("../../lua/limits.lua");

/// A script call: its op, its keys, and its one argument (ARGV[1], a JSON object). The
/// last `plans` keys are the owners' plans (see the script's "Plans").
#[derive(Debug, Clone)]
pub struct Call {
    pub op: Op,
    pub keys: Vec<String>,
    pub argument: String,
    pub plans: usize,
}

/// What the script is asked to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Charge,
    Lease,
    Settle,
    Touch,
    Release,
    /// Where a tenant stands, charging nothing.
    Peek,
    /// Deletes a tenant's counters.
    Reset,
}

impl Op {
    /// Whether the op reads the owners' plans: those that weigh a limit's capacity (a
    /// settlement's refund is capped by it), not those about slots or keys alone.
    fn reads_plans(self) -> bool {
        matches!(self, Op::Charge | Op::Lease | Op::Settle | Op::Peek)
    }

    /// The op's name, as the script knows it.
    pub fn name(self) -> &'static str {
        match self {
            Op::Charge => "charge",
            Op::Lease => "lease",
            Op::Settle => "settle",
            Op::Touch => "touch",
            Op::Release => "release",
            Op::Peek => "peek",
            Op::Reset => "reset",
        }
    }
}

/// ARGV[1]. Each op takes only its own fields: the script refuses any other.
#[derive(Serialize)]
struct Arguments<'a> {
    #[serde(serialize_with = "op_name")]
    op: Op,
    /// charge, and settle with stand_in: how long the reservation record lives (ms);
    /// absent: no record.
    #[serde(skip_serializing_if = "Option::is_none")]
    reservation_ttl_ms: Option<u64>,
    /// lease: the share of what is left that one grant may take.
    #[serde(skip_serializing_if = "Option::is_none")]
    share: Option<f64>,
    /// settle: the record key is an at-most-once marker to create, living this long (ms).
    #[serde(skip_serializing_if = "Option::is_none")]
    once_ttl_ms: Option<u64>,
    /// settle, 1: the debits stand in for the record's charge, which was never answered.
    #[serde(skip_serializing_if = "Option::is_none")]
    stand_in: Option<u8>,
    /// How many of the last keys are plans (absent: none).
    #[serde(skip_serializing_if = "is_zero")]
    plans: usize,
    limits: Vec<Limit<'a>>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// How long a stand-alone adjustment's marker outlives it: longer than the filter keeps
/// sending a batch again (8 attempts over about 20 s, backing off to 5 s), and short, as
/// every returned lease leaves one.
pub const ONCE_TTL_MS: u64 = 60 * 1000;

/// One limit as the script takes it; `name` only makes its key.
#[derive(Serialize)]
struct Limit<'a> {
    #[serde(skip)]
    name: &'a str,
    /// Whose counter (a shared pool's id), when not the call's tenant's: only its key.
    #[serde(skip)]
    owner: Option<&'a str>,
    #[serde(serialize_with = "script_kind")]
    kind: LimitKind,
    capacity: u64,
    window_ms: u64,
    /// A calendar budget's period boundaries, as the filter sent them.
    #[serde(skip_serializing_if = "<[u64]>::is_empty")]
    bounds: &'a [u64],
    #[serde(flatten)]
    amounts: Amounts,
    /// charge: the pool's fair shares, the claimant charging it (see the script's "Fair
    /// shares").
    #[serde(skip_serializing_if = "Option::is_none")]
    fair: Option<ScriptFair<'a>>,
    /// The owner's plan: which of the plan keys, and the limit's name in it.
    #[serde(skip_serializing_if = "Option::is_none")]
    plan: Option<ScriptPlan<'a>>,
}

#[derive(Serialize)]
struct ScriptPlan<'a> {
    at: usize,
    name: &'a str,
}

/// A fair pool's claimant under the script's names.
#[derive(Serialize)]
struct ScriptFair<'a> {
    id: &'a str,
    weight: u32,
    max: u32,
    idle_ms: u64,
}

impl<'a> ScriptFair<'a> {
    fn of(claim: &'a FairClaim) -> ScriptFair<'a> {
        ScriptFair { id: &claim.claimant, weight: claim.weight, max: claim.max_claimants, idle_ms: claim.idle_ms }
    }
}

impl<'a> Limit<'a> {
    fn of(
        name: &'a str,
        kind: LimitKind,
        capacity: u64,
        window_ms: u64,
        bounds: &'a [u64],
        amounts: Amounts,
    ) -> Limit<'a> {
        Limit { name, owner: None, kind, capacity, window_ms, bounds, amounts, fair: None, plan: None }
    }

    fn owned_by(self, owner: Option<&'a str>) -> Limit<'a> {
        Limit { owner, ..self }
    }

    fn claimed_by(self, fair: Option<&'a FairClaim>) -> Limit<'a> {
        Limit { fair: fair.map(ScriptFair::of), ..self }
    }
}

/// What each op says about a limit beyond its kind and size, under the script's names.
#[derive(Serialize)]
#[serde(untagged)]
enum Amounts {
    Charge {
        cost: u64,
        min_cost: u64,
        #[serde(skip_serializing_if = "Option::is_none")]
        look_only: Option<u8>,
        #[serde(skip_serializing_if = "Option::is_none")]
        shadow: Option<u8>,
    },
    Lease {
        wanted: u64,
        needed: u64,
        #[serde(skip_serializing_if = "Option::is_none")]
        look_only: Option<u8>,
    },
    Settle {
        credit: i64,
    },
    /// touch and release: nothing more.
    Nothing {},
}

/// A flag as the script takes it (its fields are numbers): 1 when set, absent otherwise,
/// so calls without it read as they did before it existed.
fn script_flag(set: bool) -> Option<u8> {
    set.then_some(1)
}

fn op_name<S: serde::Serializer>(op: &Op, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(op.name())
}

fn script_kind<S: serde::Serializer>(kind: &LimitKind, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(kind.script_name())
}

fn call(prefix: &str, domain: &str, tenant: &str, arguments: &mut Arguments, reservation: Option<&str>) -> Call {
    // The kind is part of the key: a limit that changes kind starts afresh rather than
    // meeting a key of the other type.
    // A shared pool's counter is its owner's, in the owner's hash slot (see `pools` for
    // a cluster, where a call's keys must share one).
    let mut keys: Vec<String> = arguments
        .limits
        .iter()
        .map(|l| key(prefix, domain, l.owner.unwrap_or(tenant), l.kind.script_name(), l.name))
        .collect();
    if let Some(id) = reservation {
        keys.push(key(prefix, domain, tenant, RESERVATION_KIND, id));
    }
    // Each owner's plan once, in the owner's slot, after every other key.
    let mut owners: Vec<&str> = Vec::new();
    if arguments.op.reads_plans() {
        for limit in &mut arguments.limits {
            let owner = limit.owner.unwrap_or(tenant);
            let at = match owners.iter().position(|o| *o == owner) {
                Some(i) => i + 1,
                None => {
                    owners.push(owner);
                    owners.len()
                }
            };
            limit.plan = Some(ScriptPlan { at, name: limit.name });
        }
    }
    arguments.plans = owners.len();
    keys.extend(owners.iter().map(|owner| key(prefix, domain, owner, PLAN_KIND, PLAN_NAME)));
    // Serialising plain structs of numbers and strings cannot fail; an empty argument
    // would still be refused by the script, never misread.
    let argument = serde_json::to_string(arguments).unwrap_or_default();
    Call { op: arguments.op, keys, argument, plans: owners.len() }
}

impl Call {
    /// Adds a key of the call's own before the plans' (the cancel marker, a once marker).
    fn push_own_key(&mut self, key: String) {
        let at = self.keys.len() - self.plans;
        self.keys.insert(at, key);
    }

    /// Adds the request's cancel marker (see the script): a charge checks it, a cancelling
    /// or standing-in settlement sets it.
    pub fn with_cancel_marker(mut self, prefix: &str, domain: &str, tenant: &str, id: &str) -> Call {
        self.push_own_key(key(prefix, domain, tenant, CANCEL_KIND, id));
        self
    }
}

pub fn charge(prefix: &str, request: &ChargeRequest) -> Call {
    let reservation = request.reservation.as_ref();
    let limits = request
        .limits
        .iter()
        .map(|l| {
            Limit::of(
                &l.name,
                l.kind,
                l.capacity,
                l.window_ms,
                &l.period_bounds_ms,
                Amounts::Charge {
                    cost: l.cost,
                    min_cost: l.min(),
                    look_only: script_flag(l.look_only),
                    shadow: script_flag(l.shadow),
                },
            )
            .owned_by(l.owner.as_deref())
            .claimed_by(l.fair.as_ref())
        })
        .collect();
    let mut arguments = Arguments {
        op: Op::Charge,
        reservation_ttl_ms: Some(reservation.map_or(0, |r| r.ttl_ms)),
        share: None,
        once_ttl_ms: None,
        stand_in: None,
        plans: 0,
        limits,
    };
    let call = call(prefix, &request.domain, &request.tenant, &mut arguments, reservation.map(|r| r.id.as_str()));
    // Every charge under a reservation checks its cancel marker: a proxy that stopped
    // waiting for the answer cancels it (or stands in for it) and a charge that reaches
    // Redis after that must not count as well.
    match reservation {
        Some(r) => call.with_cancel_marker(prefix, &request.domain, &request.tenant, &r.id),
        None => call,
    }
}

pub fn lease(prefix: &str, request: &LeaseRequest) -> Call {
    let limits = request
        .limits
        .iter()
        .map(|l| {
            let needed = l.needed.map_or(l.wanted, |needed| needed.min(l.wanted));
            Limit::of(
                &l.name,
                l.kind,
                l.capacity,
                l.window_ms,
                &[],
                Amounts::Lease { wanted: l.wanted, needed, look_only: script_flag(l.look_only) },
            )
            .owned_by(l.owner.as_deref())
        })
        .collect();
    let mut arguments = Arguments {
        op: Op::Lease,
        reservation_ttl_ms: None,
        share: Some(request.share),
        once_ttl_ms: None,
        stand_in: None,
        plans: 0,
        limits,
    };
    call(prefix, &request.domain, &request.tenant, &mut arguments, None)
}

/// A settlement (`Op::Settle`), or a heartbeat for (`Op::Touch`) or early release of
/// (`Op::Release`) the slots it names. Only a settlement carries the credits.
pub fn adjust(prefix: &str, op: Op, settlement: &Settlement) -> Call {
    let limits = settlement
        .limits
        .iter()
        .map(|l| {
            let amounts = match op {
                Op::Settle => Amounts::Settle { credit: l.credit },
                _ => Amounts::Nothing {},
            };
            Limit::of(&l.name, l.kind, l.capacity, l.window_ms, &l.period_bounds_ms, amounts)
                .owned_by(l.owner.as_deref())
        })
        .collect();
    let (domain, tenant) = (&settlement.domain, &settlement.tenant);
    // A stand-alone settlement with a once id: its marker takes the record's place.
    let once = settlement.once.as_deref().filter(|_| op == Op::Settle && settlement.reservation.is_none());
    let once_ttl_ms = once.map(|_| ONCE_TTL_MS);
    let stand_in = settlement.stand_in.as_ref().filter(|_| op == Op::Settle && settlement.reservation.is_some());
    let mut arguments = Arguments {
        op,
        reservation_ttl_ms: stand_in.map(|s| s.record_ttl_ms),
        share: None,
        once_ttl_ms,
        stand_in: stand_in.map(|_| 1),
        plans: 0,
        limits,
    };
    let mut call = call(prefix, domain, tenant, &mut arguments, settlement.reservation.as_deref());
    if let Some(once) = once {
        call.push_own_key(key(prefix, domain, tenant, ONCE_KIND, once));
    }
    match (&settlement.reservation, settlement.cancel || stand_in.is_some()) {
        (Some(id), true) => call.with_cancel_marker(prefix, domain, tenant, id),
        _ => call,
    }
}

/// A peek (`Op::Peek`) or a reset (`Op::Reset`) of a tenant's limits.
pub fn tenant(prefix: &str, op: Op, request: &TenantLimits) -> Call {
    let limits = request
        .limits
        .iter()
        .map(|l| Limit::of(&l.name, l.kind, l.capacity, l.window_ms, &l.period_bounds_ms, Amounts::Nothing {}))
        .collect();
    let mut arguments =
        Arguments { op, reservation_ttl_ms: None, share: None, once_ttl_ms: None, stand_in: None, plans: 0, limits };
    call(prefix, &request.domain, &request.tenant, &mut arguments, None)
}

/// A peek's reply as where the tenant stands on each limit of `request` (its reservations
/// are counted apart, see `reservations`).
pub fn usage(request: &TenantLimits, value: &Value) -> Result<UsageReply, String> {
    let outcomes = reply(request.limits.iter().map(|l| l.name.as_str()), value)?;
    let limits = request
        .limits
        .iter()
        .zip(outcomes.limits)
        .map(|(spec, outcome)| LimitUsage {
            name: outcome.name,
            kind: spec.kind,
            limit: outcome.limit,
            remaining: outcome.remaining,
            used: outcome.limit.saturating_sub(outcome.remaining),
            reset_after_ms: outcome.reset_after_ms,
            retry_after_ms: outcome.retry_after_ms,
        })
        .collect();
    Ok(UsageReply { limits, reservations: 0, reservations_complete: false })
}

/// Several calls as one script call (the script's `calls` form): their keys in order, and
/// each argument with how many of the keys are its own. On a cluster the caller keeps
/// every key of a batch in one hash slot.
pub fn batch<'a>(calls: impl IntoIterator<Item = &'a Call>) -> (Vec<String>, String) {
    let mut keys = Vec::new();
    let mut argument = String::from(r#"{"calls":["#);
    for (i, call) in calls.into_iter().enumerate() {
        if i > 0 {
            argument.push(',');
        }
        // Each argument is a JSON object already: it goes in as it is.
        argument.push_str(&format!(r#"{{"keys":{},"call":{}}}"#, call.keys.len(), call.argument));
        keys.extend(call.keys.iter().cloned());
    }
    argument.push_str("]}");
    (keys, argument)
}

/// A batch's reply, one element per call: the call's reply, or the error it failed with.
pub fn batch_replies(value: &Value, calls: usize) -> Result<Vec<Result<&Value, String>>, String> {
    let items = as_array(value)?;
    if items.len() != calls {
        return Err(format!("batch reply has {} elements for {calls} calls", items.len()));
    }
    Ok(items
        .iter()
        .map(|item| match item {
            Value::Array(_) => Ok(item),
            Value::BulkString(bytes) => Err(String::from_utf8_lossy(bytes).into_owned()),
            Value::SimpleString(text) => Err(text.clone()),
            other => Err(format!("unexpected element {other:?}")),
        })
        .collect())
}

/// The script's reply for the limits named `names`, in order.
pub fn reply<'a>(mut names: impl ExactSizeIterator<Item = &'a str>, value: &Value) -> Result<LimitsReply, String> {
    let items = as_array(value)?;
    let (done, outcomes) = items.split_first().ok_or("empty reply")?;
    // A suspended owner: { -1, reason, the first such limit (0-based) }.
    if as_int(done)? == -1 {
        let [reason, at] = outcomes else {
            return Err(format!("a suspension has {} fields, expected 2", outcomes.len()));
        };
        let at = usize::try_from(as_int(at)?).map_err(|_| "a suspension names no limit".to_string())?;
        let limit = names.nth(at).ok_or_else(|| format!("a suspension names limit {at} of fewer"))?;
        let reason = match reason {
            Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
            Value::SimpleString(text) => text.clone(),
            other => return Err(format!("a suspension's reason is {other:?}")),
        };
        let suspended = Some(Suspension { limit: limit.to_string(), reason });
        return Ok(LimitsReply { allowed: false, waited_ms: 0, limits: Vec::new(), suspended });
    }
    if outcomes.len() != names.len() {
        return Err(format!("reply has {} outcomes for {} limits", outcomes.len(), names.len()));
    }
    let limits = outcomes
        .iter()
        .zip(names)
        .map(|(outcome, name)| {
            let fields: Vec<i64> = as_array(outcome)?.iter().map(as_int).collect::<Result<_, _>>()?;
            let [status, limit, remaining, reset_after_ms, retry_after_ms, charged] = fields[..] else {
                return Err(format!("outcome has {} fields, expected 6", fields.len()));
            };
            let status = match status {
                1 => LimitStatus::Allowed,
                0 => LimitStatus::Limited,
                -1 => LimitStatus::Never,
                other => return Err(format!("unknown status {other}")),
            };
            let non_negative = |n: i64| u64::try_from(n).unwrap_or(0);
            Ok(LimitOutcome {
                name: name.to_string(),
                status,
                limit: non_negative(limit),
                remaining: non_negative(remaining),
                reset_after_ms: non_negative(reset_after_ms),
                retry_after_ms: non_negative(retry_after_ms),
                charged: non_negative(charged),
            })
        })
        .collect::<Result<_, String>>()?;
    Ok(LimitsReply { allowed: as_int(done)? == 1, waited_ms: 0, limits, suspended: None })
}

fn as_array(value: &Value) -> Result<&[Value], String> {
    match value {
        Value::Array(items) => Ok(items),
        other => Err(format!("expected an array, got {other:?}")),
    }
}

fn as_int(value: &Value) -> Result<i64, String> {
    match value {
        Value::Int(n) => Ok(*n),
        other => Err(format!("expected an integer, got {other:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use llm_ratelimit_protocol::{Adjustment, LeaseAsk, LimitCharge, Reservation};
    use serde_json::{json, Value as Json};

    fn request() -> ChargeRequest {
        ChargeRequest {
            domain: "llm".into(),
            tenant: "abc123".into(),
            limits: vec![
                LimitCharge {
                    owner: None,
                    shadow: false,
                    name: "rpm".into(),
                    capacity: 20,
                    window_ms: 60_000,
                    cost: 1,
                    min_cost: None,
                    kind: LimitKind::TokenBucket,
                    period_bounds_ms: Vec::new(),
                    provisional: false,
                    look_only: false,
                    fair: None,
                },
                LimitCharge {
                    owner: None,
                    shadow: false,
                    name: "tpm".into(),
                    capacity: 10_000,
                    window_ms: 60_000,
                    cost: 750,
                    min_cost: None,
                    kind: LimitKind::TokenBucket,
                    period_bounds_ms: Vec::new(),
                    provisional: true,
                    look_only: false,
                    fair: None,
                },
            ],
            reservation: Some(Reservation { id: "r42".into(), ttl_ms: 900_000 }),
            wait: None,
        }
    }

    fn argument(call: &Call) -> Json {
        serde_json::from_str(&call.argument).expect("ARGV[1] is JSON")
    }

    fn settlement(reservation: Option<&str>, kind: LimitKind, credit: i64) -> Settlement {
        Settlement {
            domain: "llm".into(),
            tenant: "abc123".into(),
            reservation: reservation.map(Into::into),
            once: None,
            cancel: false,
            stand_in: None,
            limits: vec![Adjustment {
                owner: None,
                name: "tpm".into(),
                capacity: 10_000,
                window_ms: 60_000,
                credit,
                kind,
                period_bounds_ms: Vec::new(),
            }],
        }
    }

    #[test]
    fn a_charge_puts_every_key_under_one_hash_tag() {
        let call = charge("llmrl:", &request());
        // The cancel marker with every reservation: a proxy that stopped waiting for the
        // answer may cancel the charge (or stand in for it) before it runs.
        assert_eq!(
            call.keys,
            vec![
                "llmrl:{llm:abc123}:tb:rpm",
                "llmrl:{llm:abc123}:tb:tpm",
                "llmrl:{llm:abc123}:res:r42",
                "llmrl:{llm:abc123}:cancel:r42",
                "llmrl:{llm:abc123}:plan:limits"
            ]
        );
        // The tenant's plan, once for both limits, last.
        assert_eq!(
            argument(&call),
            json!({
                "op": "charge",
                "reservation_ttl_ms": 900_000,
                "plans": 1,
                "limits": [
                    {"kind": "tb", "capacity": 20, "window_ms": 60_000, "cost": 1, "min_cost": 1,
                     "plan": {"at": 1, "name": "rpm"}},
                    {"kind": "tb", "capacity": 10_000, "window_ms": 60_000, "cost": 750, "min_cost": 750,
                     "plan": {"at": 1, "name": "tpm"}},
                ],
            })
        );
        let mut plain = request();
        plain.reservation = None;
        let call = charge("p:", &plain);
        assert_eq!(call.keys.len(), 3);
        assert_eq!(argument(&call)["reservation_ttl_ms"], 0);
    }

    #[test]
    fn an_elastic_charge_passes_its_least_cost() {
        let mut request = request();
        request.limits[1].min_cost = Some(100);
        request.limits[0].min_cost = Some(5); // above the cost: the cost is the least
        let limits = &argument(&charge("p:", &request))["limits"];
        assert_eq!((&limits[0]["cost"], &limits[0]["min_cost"]), (&json!(1), &json!(1)));
        assert_eq!((&limits[1]["cost"], &limits[1]["min_cost"]), (&json!(750), &json!(100)));
    }

    #[test]
    fn a_settlement_carries_signed_credits_and_its_reservation() {
        let call = adjust("llmrl:", Op::Settle, &settlement(Some("r42"), LimitKind::TokenBucket, -120));
        assert_eq!(
            call.keys,
            vec!["llmrl:{llm:abc123}:tb:tpm", "llmrl:{llm:abc123}:res:r42", "llmrl:{llm:abc123}:plan:limits"]
        );
        // A refund is capped by the capacity: the plan's, when it sets one.
        assert_eq!(
            argument(&call),
            json!({"op": "settle", "plans": 1, "limits": [{"kind": "tb", "capacity": 10_000, "window_ms": 60_000,
                "credit": -120, "plan": {"at": 1, "name": "tpm"}}]})
        );
    }

    #[test]
    fn a_cancelling_settlement_adds_the_cancel_marker() {
        let mut cancelling = settlement(Some("r42"), LimitKind::TokenBucket, 750);
        cancelling.cancel = true;
        let call = adjust("llmrl:", Op::Settle, &cancelling);
        assert_eq!(
            call.keys,
            vec![
                "llmrl:{llm:abc123}:tb:tpm",
                "llmrl:{llm:abc123}:res:r42",
                "llmrl:{llm:abc123}:cancel:r42",
                "llmrl:{llm:abc123}:plan:limits"
            ]
        );
    }

    #[test]
    fn touch_and_release_name_the_slots_only() {
        for (op, name) in [(Op::Touch, "touch"), (Op::Release, "release")] {
            let call = adjust("llmrl:", op, &settlement(Some("r42"), LimitKind::Slots, 0));
            assert_eq!(call.keys, vec!["llmrl:{llm:abc123}:slots:tpm", "llmrl:{llm:abc123}:res:r42"]);
            assert_eq!(
                argument(&call),
                json!({"op": name, "limits": [{"kind": "slots", "capacity": 10_000, "window_ms": 60_000}]})
            );
        }
    }

    #[test]
    fn a_look_only_limit_reaches_the_script_as_1() {
        let mut request = request();
        request.limits[1].look_only = true;
        let limits = argument(&charge("llmrl:", &request))["limits"].clone();
        assert_eq!((limits[0].get("look_only"), &limits[1]["look_only"]), (None, &json!(1)));
        let lease_request = lease_request(0, None, true);
        assert_eq!(argument(&lease("llmrl:", &lease_request))["limits"][0]["look_only"], json!(1));
    }

    fn lease_request(wanted: u64, needed: Option<u64>, look_only: bool) -> LeaseRequest {
        LeaseRequest {
            domain: "llm".into(),
            tenant: "abc123".into(),
            limits: vec![LeaseAsk {
                owner: None,
                name: "tpm".into(),
                capacity: 10_000,
                window_ms: 60_000,
                wanted,
                needed,
                kind: LimitKind::TokenBucket,
                look_only,
            }],
            share: 0.5,
        }
    }

    #[test]
    fn a_lease_passes_wanted_needed_and_share() {
        let request = lease_request(500, Some(20), false);
        let call = lease("llmrl:", &request);
        assert_eq!(call.keys, vec!["llmrl:{llm:abc123}:tb:tpm", "llmrl:{llm:abc123}:plan:limits"]);
        assert_eq!(
            argument(&call),
            json!({
                "op": "lease",
                "share": 0.5,
                "plans": 1,
                "limits": [{"kind": "tb", "capacity": 10_000, "window_ms": 60_000, "wanted": 500, "needed": 20,
                    "plan": {"at": 1, "name": "tpm"}}],
            })
        );
    }

    #[test]
    fn numbers_are_written_exactly() {
        // The script reads JSON numbers as doubles, as tonumber read the old positional
        // strings; what is written here is the exact integer, and the shortest decimal
        // that reads back as the same share.
        let mut request = request();
        request.limits[0].capacity = (1 << 53) + 1;
        request.limits[0].cost = u64::MAX;
        let text = charge("p:", &request).argument;
        assert!(text.contains(r#""capacity":9007199254740993"#), "{text}");
        assert!(text.contains(r#""cost":18446744073709551615"#), "{text}");
        let share = 0.1 + 0.2;
        let ask = LeaseAsk {
            owner: None,
            name: "tpm".into(),
            capacity: 1,
            window_ms: 1,
            wanted: 1,
            needed: None,
            kind: LimitKind::TokenBucket,
            look_only: false,
        };
        let request = LeaseRequest { domain: "llm".into(), tenant: "t".into(), limits: vec![ask], share };
        let written = argument(&lease("p:", &request))["share"].as_f64();
        assert_eq!(written.map(f64::to_bits), Some(share.to_bits()));
    }

    #[test]
    fn slot_limits_have_their_own_keys_and_kind() {
        let mut request = request();
        request.limits[1].kind = LimitKind::Slots;
        let call = charge("llmrl:", &request);
        assert_eq!(call.keys[1], "llmrl:{llm:abc123}:slots:tpm");
        assert_eq!(argument(&call)["limits"][1]["kind"], "slots");
    }

    #[test]
    fn a_settlement_without_reservation_stands_alone() {
        let settlement = Settlement {
            domain: "llm".into(),
            tenant: "t".into(),
            reservation: None,
            once: None,
            cancel: false,
            stand_in: None,
            limits: vec![Adjustment {
                owner: None,
                name: "rpm".into(),
                capacity: 10,
                window_ms: 60_000,
                credit: -1,
                kind: LimitKind::TokenBucket,
                period_bounds_ms: Vec::new(),
            }],
        };
        assert_eq!(adjust("p:", Op::Settle, &settlement).keys, vec!["p:{llm:t}:tb:rpm", "p:{llm:t}:plan:limits"]);
        assert_eq!(argument(&adjust("p:", Op::Settle, &settlement)).get("once_ttl_ms"), None);
        // With a once id, its marker is the record: applied at most once.
        let once = Settlement { once: Some("f00d1".into()), ..settlement };
        let call = adjust("p:", Op::Settle, &once);
        assert_eq!(call.keys, vec!["p:{llm:t}:tb:rpm", "p:{llm:t}:once:f00d1", "p:{llm:t}:plan:limits"]);
        assert_eq!(argument(&call)["once_ttl_ms"], ONCE_TTL_MS);
    }

    #[test]
    fn maps_the_script_reply() {
        let outcome = |s, l, r, reset, retry| {
            Value::Array(vec![
                Value::Int(s),
                Value::Int(l),
                Value::Int(r),
                Value::Int(reset),
                Value::Int(retry),
                Value::Int(0),
            ])
        };
        let value =
            Value::Array(vec![Value::Int(0), outcome(1, 20, 3, 51_000, 0), outcome(0, 10_000, 0, 60_000, 4_500)]);
        let reply = reply(["rpm", "tpm"].into_iter(), &value).expect("valid reply");
        assert!(!reply.allowed);
        assert_eq!(reply.limits[0].status, LimitStatus::Allowed);
        assert_eq!(reply.limits[0].remaining, 3);
        assert_eq!(reply.limits[1].status, LimitStatus::Limited);
        assert_eq!(reply.limits[1].retry_after_ms, 4_500);
        assert_eq!(reply.limits[1].name, "tpm");
    }

    #[test]
    fn maps_a_suspension_to_the_limit_it_names() {
        let suspended = |at| Value::Array(vec![Value::Int(-1), Value::BulkString(b"invoice unpaid".to_vec()), at]);
        let reply = reply(["rpm", "team-tpm"].into_iter(), &suspended(Value::Int(1))).expect("valid reply");
        assert!(!reply.allowed && reply.limits.is_empty());
        assert_eq!(reply.suspended, Some(Suspension { limit: "team-tpm".into(), reason: "invoice unpaid".into() }));
        for bad in [Value::Int(2), Value::Int(-1), Value::Nil] {
            assert!(super::reply(["rpm", "team-tpm"].into_iter(), &suspended(bad)).is_err());
        }
    }

    #[test]
    fn a_stand_in_carries_its_record_and_cancel_marker() {
        let stand_in = Settlement {
            stand_in: Some(llm_ratelimit_protocol::StandIn { record_ttl_ms: 900_000 }),
            ..settlement(Some("r42"), LimitKind::TokenBucket, -750)
        };
        let call = adjust("llmrl:", Op::Settle, &stand_in);
        assert_eq!(
            call.keys,
            vec![
                "llmrl:{llm:abc123}:tb:tpm",
                "llmrl:{llm:abc123}:res:r42",
                "llmrl:{llm:abc123}:cancel:r42",
                "llmrl:{llm:abc123}:plan:limits"
            ]
        );
        assert_eq!(argument(&call)["stand_in"], 1);
        assert_eq!(argument(&call)["reservation_ttl_ms"], 900_000);
        assert_eq!(argument(&call).get("once_ttl_ms"), None);
        // Only a settlement stands in; a plain one says nothing of it.
        assert_eq!(
            argument(&adjust("llmrl:", Op::Settle, &settlement(Some("r42"), LimitKind::TokenBucket, 5)))
                .get("stand_in"),
            None
        );
    }

    #[test]
    fn a_batch_carries_each_call_with_its_number_of_keys() {
        let settle = adjust("p:", Op::Settle, &settlement(Some("r1"), LimitKind::TokenBucket, 5));
        let plain = charge("p:", &request());
        let (keys, argument_text) = batch([&settle, &plain]);
        assert_eq!(keys, [settle.keys.clone(), plain.keys.clone()].concat());
        assert_eq!(
            serde_json::from_str::<Json>(&argument_text).expect("ARGV[1] is JSON"),
            json!({"calls": [
                {"keys": 3, "call": argument(&settle)},
                {"keys": 5, "call": argument(&plain)},
            ]})
        );
    }

    #[test]
    fn a_batch_reply_gives_each_call_its_reply_or_its_error() {
        let ok = Value::Array(vec![Value::Int(1)]);
        let value = Value::Array(vec![
            ok.clone(),
            Value::BulkString(b"CANCELLED the request was abandoned".to_vec()),
            Value::Int(3),
        ]);
        let replies = batch_replies(&value, 3).expect("three elements");
        assert_eq!(replies[0], Ok(&ok));
        assert_eq!(replies[1], Err("CANCELLED the request was abandoned".to_string()));
        assert!(replies[2].is_err());
        assert!(batch_replies(&value, 2).is_err(), "a reply of another length is refused whole");
        assert!(batch_replies(&Value::Int(1), 1).is_err());
    }

    #[test]
    fn rejects_malformed_replies() {
        let malformed = [
            Value::Int(1),
            Value::Array(vec![]),
            Value::Array(vec![Value::Int(1)]),
            Value::Array(vec![Value::Int(1), Value::Int(2), Value::Int(3)]),
        ];
        for value in malformed {
            assert!(reply(["rpm", "tpm"].into_iter(), &value).is_err(), "{value:?}");
        }
    }
}
