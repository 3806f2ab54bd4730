//! The exchange of provider words between proxies (`PROVIDER_PATH`): a proxy worker hands
//! in what replies told it about the providers' own limits since its last exchange and
//! gets back every key the fleet knows about, with who sends the probe past a retry
//! time, in one call of `lua/provider.lua` on the domain's hash. A worker exchanges at
//! most every 200 ms with news and once a second without, so it is not batched.

use crate::store::{Script, Store};
use llm_ratelimit_protocol::keys::{redis_key, PROVIDER_KIND, PROVIDER_NAME, PROVIDER_TENANT};
use llm_ratelimit_protocol::{
    ProbeBy, ProviderEntry, ProviderExchange, ProviderReply, MAX_PROVIDER_ENTRIES, PROBE_HOLD_MS, PROBE_OFFER_MS,
    QUOTAS,
};
use redis::Value;
use serde_json::json;

pub const SOURCE: &str = include_str!("../../lua/provider.lua");

/// How long a domain's hash outlives its last exchange (its entries expire sooner).
const TTL_MS: u64 = 24 * 3600 * 1000;

pub async fn exchange(
    store: &Store,
    script: &Script,
    prefix: &str,
    request: &ProviderExchange,
) -> Result<ProviderReply, String> {
    let key = redis_key(prefix, &request.domain, PROVIDER_TENANT, PROVIDER_KIND, PROVIDER_NAME);
    let args = json!({
        "proxy": request.proxy, "offer_ms": PROBE_OFFER_MS, "hold_ms": PROBE_HOLD_MS, "ttl_ms": TTL_MS,
        "max_entries": MAX_PROVIDER_ENTRIES, "reports": request.reports,
    })
    .to_string();
    let value = store.run(script, &[key], &[&args]).await.map_err(|e| format!("redis: {e}"))?;
    reply(&value)
}

/// The script's reply: one line per key, "key said out refused probe probe_until" and
/// the quotas' "remaining until" pairs.
fn reply(value: &Value) -> Result<ProviderReply, String> {
    let Value::Array(lines) = value else { return Err(format!("not an array: {value:?}")) };
    let entries = lines
        .iter()
        .map(|line| match line {
            Value::BulkString(bytes) => entry(&String::from_utf8_lossy(bytes)),
            other => Err(format!("not a line: {other:?}")),
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(ProviderReply { entries })
}

fn entry(line: &str) -> Result<ProviderEntry, String> {
    let fields: Vec<&str> = line.split(' ').collect();
    let [key, said, out, refused, probe, probe_until, quotas @ ..] = fields.as_slice() else {
        return Err(format!("short line {line:?}"));
    };
    let number = |text: &str| text.parse::<u64>().map_err(|_| format!("bad number {text:?} in {line:?}"));
    if quotas.len() != 2 * QUOTAS {
        return Err(format!("{} quota fields in {line:?}", quotas.len()));
    }
    let left = quotas
        .chunks(2)
        .map(|pair| match pair {
            [remaining, until] => Ok([number(remaining)?, number(until)?]),
            _ => Err(format!("odd quota fields in {line:?}")),
        })
        .collect::<Result<Vec<_>, String>>()?;
    let probe = match *probe {
        "you" => ProbeBy::You,
        "another" => ProbeBy::Another,
        "nobody" => ProbeBy::Nobody,
        other => return Err(format!("bad probe {other:?}")),
    };
    Ok(ProviderEntry {
        key: key.to_string(),
        said_ms: number(said)?,
        out_until_ms: number(out)?,
        refused: *refused == "1",
        probe,
        probe_until_ms: number(probe_until)?,
        left,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_scripts_lines_exactly() {
        let line = "00112233aabbccdd 1796139400000 1796139405000 1 you 1796139407000 0 1796139405000 500 1796139460000 0 0 0 0";
        let reply = reply(&Value::Array(vec![Value::BulkString(line.into())])).expect("reply");
        let entry = &reply.entries[0];
        assert_eq!((entry.said_ms, entry.out_until_ms, entry.refused), (1_796_139_400_000, 1_796_139_405_000, true));
        assert_eq!((entry.probe, entry.probe_until_ms), (ProbeBy::You, 1_796_139_407_000));
        assert_eq!(entry.left[1], [500, 1_796_139_460_000]);
    }

    #[test]
    fn a_line_it_does_not_understand_is_an_error_not_a_guess() {
        for line in ["", "k 1 2 1 you 3 0 0", "k 1 2 1 maybe 3 0 0 0 0 0 0 0 0", "k x 2 1 you 3 0 0 0 0 0 0 0 0"] {
            assert!(reply(&Value::Array(vec![Value::BulkString(line.into())])).is_err(), "{line}");
        }
        assert!(reply(&Value::Int(1)).is_err());
    }
}
