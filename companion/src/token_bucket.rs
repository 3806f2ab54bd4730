//! The translation between the JSON endpoints and `lua/token_bucket.lua`: KEYS and ARGV
//! for a charge or a settlement, and the script's reply back to JSON.

use llm_ratelimit_protocol::keys::{redis_key as key, CANCEL_KIND, RESERVATION_KIND};
use llm_ratelimit_protocol::{
    ChargeRequest, LeaseRequest, LimitCharge, LimitKind, LimitOutcome, LimitStatus, LimitsReply, Settlement,
};
use redis::Value;

pub const SOURCE: &str = include_str!("../../lua/token_bucket.lua");

/// A script call: its keys and arguments.
pub struct Call {
    pub keys: Vec<String>,
    pub args: Vec<String>,
}

/// One limit as the script takes it.
struct Limit<'a> {
    name: &'a str,
    kind: LimitKind,
    capacity: u64,
    window_ms: u64,
    amount: String,
    min: String,
}

fn call<'a>(
    prefix: &str,
    op: &str,
    domain: &str,
    tenant: &str,
    limits: impl Iterator<Item = Limit<'a>>,
    third: String,
    reservation: Option<&str>,
) -> Call {
    let mut keys = Vec::new();
    let mut per_limit = Vec::new();
    for limit in limits {
        // The kind is part of the key: a limit that changes kind starts afresh rather
        // than meeting a key of the other type.
        keys.push(key(prefix, domain, tenant, limit.kind.script_name(), limit.name));
        per_limit.extend([
            limit.kind.script_name().to_string(),
            limit.capacity.to_string(),
            limit.window_ms.to_string(),
            limit.amount,
            limit.min,
        ]);
    }
    let mut args = vec![op.to_string(), keys.len().to_string(), third];
    args.extend(per_limit);
    if let Some(id) = reservation {
        keys.push(key(prefix, domain, tenant, RESERVATION_KIND, id));
    }
    Call { keys, args }
}

impl Call {
    /// Adds the request's cancel marker (see the script): a waiting charge checks it, a
    /// cancelling settlement sets it.
    pub fn with_cancel_marker(mut self, prefix: &str, domain: &str, tenant: &str, id: &str) -> Call {
        self.keys.push(key(prefix, domain, tenant, CANCEL_KIND, id));
        self
    }
}

fn spec_limits(specs: &[LimitCharge]) -> impl Iterator<Item = Limit<'_>> {
    specs.iter().map(|l| Limit {
        name: &l.name,
        kind: l.kind,
        capacity: l.capacity,
        window_ms: l.window_ms,
        amount: l.cost.to_string(),
        min: l.min().to_string(),
    })
}

pub fn charge(prefix: &str, request: &ChargeRequest) -> Call {
    let reservation = request.reservation.as_ref();
    let ttl = reservation.map_or(0, |r| r.ttl_ms).to_string();
    let limits = spec_limits(&request.limits);
    call(prefix, "charge", &request.domain, &request.tenant, limits, ttl, reservation.map(|r| r.id.as_str()))
}

pub fn lease(prefix: &str, request: &LeaseRequest) -> Call {
    let limits = request.limits.iter().map(|l| Limit {
        name: &l.name,
        kind: l.kind,
        capacity: l.capacity,
        window_ms: l.window_ms,
        amount: l.wanted.to_string(),
        min: l.needed.map_or(l.wanted, |needed| needed.min(l.wanted)).to_string(),
    });
    call(prefix, "lease", &request.domain, &request.tenant, limits, request.share.to_string(), None)
}

/// A settlement (`op` "settle") or a heartbeat for the slots it names (`op` "touch").
pub fn adjust(prefix: &str, op: &str, settlement: &Settlement) -> Call {
    let limits = settlement.limits.iter().map(|l| Limit {
        name: &l.name,
        kind: l.kind,
        capacity: l.capacity,
        window_ms: l.window_ms,
        amount: l.credit.to_string(),
        // The script ignores the minimum here; it only keeps the layout uniform.
        min: "0".to_string(),
    });
    let call =
        call(prefix, op, &settlement.domain, &settlement.tenant, limits, "0".into(), settlement.reservation.as_deref());
    match (&settlement.reservation, settlement.cancel) {
        (Some(id), true) => call.with_cancel_marker(prefix, &settlement.domain, &settlement.tenant, id),
        _ => call,
    }
}

/// The script's reply for buckets named `names`, in order.
pub fn reply<'a>(names: impl ExactSizeIterator<Item = &'a str>, value: &Value) -> Result<LimitsReply, String> {
    let items = as_array(value)?;
    let (done, outcomes) = items.split_first().ok_or("empty reply")?;
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
    Ok(LimitsReply { allowed: as_int(done)? == 1, waited_ms: 0, limits })
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
    use llm_ratelimit_protocol::LimitKind;
    use llm_ratelimit_protocol::{Adjustment, LeaseAsk, Reservation};

    fn request() -> ChargeRequest {
        ChargeRequest {
            domain: "llm".into(),
            tenant: "abc123".into(),
            limits: vec![
                LimitCharge {
                    name: "rpm".into(),
                    capacity: 20,
                    window_ms: 60_000,
                    cost: 1,
                    min_cost: None,
                    kind: LimitKind::TokenBucket,
                },
                LimitCharge {
                    name: "tpm".into(),
                    capacity: 10_000,
                    window_ms: 60_000,
                    cost: 750,
                    min_cost: None,
                    kind: LimitKind::TokenBucket,
                },
            ],
            reservation: Some(Reservation { id: "r42".into(), ttl_ms: 900_000 }),
            wait: None,
        }
    }

    #[test]
    fn a_charge_puts_every_key_under_one_hash_tag() {
        let call = charge("llmrl:", &request());
        assert_eq!(
            call.keys,
            vec!["llmrl:{llm:abc123}:tb:rpm", "llmrl:{llm:abc123}:tb:tpm", "llmrl:{llm:abc123}:res:r42"]
        );
        assert_eq!(
            call.args,
            vec!["charge", "2", "900000", "tb", "20", "60000", "1", "1", "tb", "10000", "60000", "750", "750"]
        );
        let mut plain = request();
        plain.reservation = None;
        let call = charge("p:", &plain);
        assert_eq!(call.keys.len(), 2);
        assert_eq!(call.args[..3], ["charge", "2", "0"]);
    }

    #[test]
    fn a_settlement_carries_signed_credits_and_its_reservation() {
        let settlement = Settlement {
            domain: "llm".into(),
            tenant: "abc123".into(),
            reservation: Some("r42".into()),
            cancel: false,
            limits: vec![Adjustment {
                name: "tpm".into(),
                capacity: 10_000,
                window_ms: 60_000,
                credit: -120,
                kind: LimitKind::TokenBucket,
            }],
        };
        let call = adjust("llmrl:", "settle", &settlement);
        assert_eq!(call.keys, vec!["llmrl:{llm:abc123}:tb:tpm", "llmrl:{llm:abc123}:res:r42"]);
        assert_eq!(call.args, vec!["settle", "1", "0", "tb", "10000", "60000", "-120", "0"]);
    }

    #[test]
    fn a_lease_passes_wanted_needed_and_share() {
        let request = LeaseRequest {
            domain: "llm".into(),
            tenant: "abc123".into(),
            limits: vec![LeaseAsk {
                name: "tpm".into(),
                capacity: 10_000,
                window_ms: 60_000,
                wanted: 500,
                needed: Some(20),
                kind: LimitKind::TokenBucket,
            }],
            share: 0.5,
        };
        let call = lease("llmrl:", &request);
        assert_eq!(call.keys, vec!["llmrl:{llm:abc123}:tb:tpm"]);
        assert_eq!(call.args, vec!["lease", "1", "0.5", "tb", "10000", "60000", "500", "20"]);
    }

    #[test]
    fn slot_limits_have_their_own_keys_and_kind() {
        let mut request = request();
        request.limits[1].kind = LimitKind::Slots;
        let call = charge("llmrl:", &request);
        assert_eq!(call.keys[1], "llmrl:{llm:abc123}:slots:tpm");
        assert_eq!(call.args[8], "slots");
    }

    #[test]
    fn a_settlement_without_reservation_stands_alone() {
        let settlement = Settlement {
            domain: "llm".into(),
            tenant: "t".into(),
            reservation: None,
            cancel: false,
            limits: vec![Adjustment {
                name: "rpm".into(),
                capacity: 10,
                window_ms: 60_000,
                credit: -1,
                kind: LimitKind::TokenBucket,
            }],
        };
        assert_eq!(adjust("p:", "settle", &settlement).keys, vec!["p:{llm:t}:tb:rpm"]);
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
