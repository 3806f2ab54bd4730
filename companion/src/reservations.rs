//! How many reservations of a tenant await their settlement, for the usage query. The
//! records are keys of their own (`<prefix>{<domain>:<tenant>}:res:<id>`) with no index
//! (the hot path keeps none), so they are counted by SCAN with the tenant's pattern on the
//! server that holds the tenant's hash slot. SCAN visits that server's whole keyspace, in
//! steps that each hold Redis for well under a millisecond; past `MAX_EXAMINED` keys the
//! count stops and says it is incomplete (a lower bound).

use crate::metrics::{MetricOp, Metrics};
use crate::store::Store;
use llm_ratelimit_protocol::keys::{redis_key, RESERVATION_KIND};
use redis::Value;
use std::time::Instant;

/// Keys examined per SCAN step.
const STEP: u64 = 1_000;
/// Keys examined at most in one count: 1,000 steps.
const MAX_EXAMINED: u64 = 1_000_000;

/// `text` with SCAN MATCH's special characters escaped.
fn glob_escaped(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

/// The tenant's reservation records, and whether every key of the server was examined.
pub async fn count(
    store: &Store,
    metrics: &Metrics,
    prefix: &str,
    domain: &str,
    tenant: &str,
) -> Result<(u64, bool), String> {
    let any_record = redis_key(prefix, domain, tenant, RESERVATION_KIND, "");
    let pattern = format!("{}*", glob_escaped(&any_record));
    let (mut cursor, mut found, mut examined) = (String::from("0"), 0u64, 0u64);
    loop {
        let mut scan = redis::cmd("SCAN");
        scan.arg(&cursor).arg("MATCH").arg(&pattern).arg("COUNT").arg(STEP);
        let started = Instant::now();
        let reply = store.query_on_node_of(&any_record, &scan).await.map_err(|e| e.to_string());
        metrics.redis_call(MetricOp::Usage, started.elapsed());
        let (next, keys) = match reply? {
            Value::Array(parts) => match parts.as_slice() {
                [Value::BulkString(next), Value::Array(keys)] => {
                    (String::from_utf8_lossy(next).into_owned(), keys.len())
                }
                _ => return Err("unexpected SCAN reply".into()),
            },
            _ => return Err("unexpected SCAN reply".into()),
        };
        found += keys as u64;
        examined += STEP;
        if next == "0" {
            return Ok((found, true));
        }
        if examined >= MAX_EXAMINED {
            return Ok((found, false));
        }
        cursor = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_with_glob_characters_matches_only_itself() {
        assert_eq!(glob_escaped("llmrl:{llm:ab}:res:"), "llmrl:{llm:ab}:res:");
        assert_eq!(glob_escaped(r"a*b?[c]\d"), r"a\*b\?\[c\]\\d");
    }
}
