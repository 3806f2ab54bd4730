//! The `/v1/token_bucket` endpoint's translation: JSON request to KEYS/ARGV of
//! `lua/token_bucket.lua`, and the script's reply back to JSON.

use llm_ratelimit::protocol::{BucketOutcome, BucketStatus, TokenBucketReply, TokenBucketRequest};
use redis::Value;

pub const SOURCE: &str = include_str!("../../lua/token_bucket.lua");

/// `<prefix>{<domain>:<tenant>}:tb:<limit>`: the braces are a Redis Cluster hash tag, so
/// all of a tenant's buckets share a slot and one script call can touch them together.
pub fn keys(prefix: &str, request: &TokenBucketRequest) -> Vec<String> {
    request
        .limits
        .iter()
        .map(|limit| {
            format!(
                "{prefix}{{{}:{}}}:tb:{}",
                request.domain, request.tenant, limit.name
            )
        })
        .collect()
}

pub fn args(request: &TokenBucketRequest) -> Vec<String> {
    request
        .limits
        .iter()
        .flat_map(|l| {
            [
                l.capacity.to_string(),
                l.window_ms.to_string(),
                l.cost.to_string(),
            ]
        })
        .collect()
}

pub fn reply(request: &TokenBucketRequest, value: &Value) -> Result<TokenBucketReply, String> {
    let items = as_array(value)?;
    let (allowed, outcomes) = items.split_first().ok_or("empty reply")?;
    if outcomes.len() != request.limits.len() {
        return Err(format!(
            "reply has {} outcomes for {} limits",
            outcomes.len(),
            request.limits.len()
        ));
    }
    let limits = outcomes
        .iter()
        .zip(&request.limits)
        .map(|(outcome, spec)| {
            let fields: Vec<i64> = as_array(outcome)?
                .iter()
                .map(as_int)
                .collect::<Result<_, _>>()?;
            let [status, limit, remaining, reset_after_ms, retry_after_ms] = fields[..] else {
                return Err(format!("outcome has {} fields, expected 5", fields.len()));
            };
            let status = match status {
                1 => BucketStatus::Allowed,
                0 => BucketStatus::Limited,
                -1 => BucketStatus::Never,
                other => return Err(format!("unknown status {other}")),
            };
            let non_negative = |n: i64| u64::try_from(n).unwrap_or(0);
            Ok(BucketOutcome {
                name: spec.name.clone(),
                status,
                limit: non_negative(limit),
                remaining: non_negative(remaining),
                reset_after_ms: non_negative(reset_after_ms),
                retry_after_ms: non_negative(retry_after_ms),
            })
        })
        .collect::<Result<_, String>>()?;
    Ok(TokenBucketReply {
        allowed: as_int(allowed)? == 1,
        limits,
    })
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
    use llm_ratelimit::protocol::BucketSpec;

    fn request() -> TokenBucketRequest {
        TokenBucketRequest {
            domain: "llm".into(),
            tenant: "abc123".into(),
            limits: vec![
                BucketSpec {
                    name: "rpm".into(),
                    capacity: 20,
                    window_ms: 60_000,
                    cost: 1,
                },
                BucketSpec {
                    name: "rpd".into(),
                    capacity: 1000,
                    window_ms: 86_400_000,
                    cost: 1,
                },
            ],
        }
    }

    #[test]
    fn keys_share_one_hash_tag_per_tenant() {
        assert_eq!(
            keys("llmrl:", &request()),
            vec!["llmrl:{llm:abc123}:tb:rpm", "llmrl:{llm:abc123}:tb:rpd"]
        );
        assert_eq!(
            args(&request()),
            vec!["20", "60000", "1", "1000", "86400000", "1"]
        );
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
            ])
        };
        let value = Value::Array(vec![
            Value::Int(0),
            outcome(1, 20, 3, 51_000, 0),
            outcome(0, 1000, 0, 86_400_000, 86_400),
        ]);
        let reply = reply(&request(), &value).expect("valid reply");
        assert!(!reply.allowed);
        assert_eq!(reply.limits[0].status, BucketStatus::Allowed);
        assert_eq!(reply.limits[0].remaining, 3);
        assert_eq!(reply.limits[1].status, BucketStatus::Limited);
        assert_eq!(reply.limits[1].retry_after_ms, 86_400);
        assert_eq!(reply.limits[1].name, "rpd");
    }

    #[test]
    fn rejects_malformed_replies() {
        for value in [
            Value::Int(1),
            Value::Array(vec![]),
            Value::Array(vec![Value::Int(1)]),
            Value::Array(vec![Value::Int(1), Value::Int(2), Value::Int(3)]),
        ] {
            assert!(reply(&request(), &value).is_err(), "{value:?}");
        }
    }
}
