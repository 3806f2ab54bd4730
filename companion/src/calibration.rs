//! The exchange of model calibrations between proxies (`CALIBRATION_PATH`): a proxy
//! worker hands in what its settled replies taught it since its last exchange and gets
//! every rule's figures as all proxies taught them, in one call of `lua/calibration.lua`
//! on the domain's hash. Rare (a worker exchanges at most once a second), so not batched.

use crate::store::{Script, Store};
use llm_ratelimit_protocol::keys::{redis_key, CALIBRATION_KIND, CALIBRATION_NAME, CALIBRATION_TENANT};
use llm_ratelimit_protocol::{CalibrationExchange, CalibrationReply, RuleFigures, RunningFigure, CALIBRATION_WINDOW};
use redis::Value;
use serde_json::json;

pub const SOURCE: &str = include_str!("../../lua/calibration.lua");

/// How long a domain's figures outlive its last exchange: a fleet that stopped for a week
/// starts over, as the provider may have changed its counts meanwhile.
const TTL_MS: u64 = 7 * 24 * 3600 * 1000;

pub async fn exchange(
    store: &Store,
    script: &Script,
    prefix: &str,
    request: &CalibrationExchange,
) -> Result<CalibrationReply, String> {
    let key = redis_key(prefix, &request.domain, CALIBRATION_TENANT, CALIBRATION_KIND, CALIBRATION_NAME);
    let args = json!({"window": CALIBRATION_WINDOW, "ttl_ms": TTL_MS, "rules": request.rules}).to_string();
    let value = store.run(script, &[key], &[&args]).await.map_err(|e| format!("redis: {e}"))?;
    reply(&value)
}

/// The script's reply: per rule, its fingerprint and its figures as stored.
fn reply(value: &Value) -> Result<CalibrationReply, String> {
    let Value::Array(entries) = value else { return Err(format!("not an array: {value:?}")) };
    let rules = entries
        .iter()
        .map(|entry| match entry {
            Value::Array(pair) => match pair.as_slice() {
                [Value::BulkString(rule), Value::BulkString(figures)] => {
                    let figures = String::from_utf8_lossy(figures);
                    let (ratio, output) = figures.split_once('|').ok_or("figures without '|'")?;
                    Ok(RuleFigures {
                        rule: String::from_utf8_lossy(rule).into_owned(),
                        prompt_ratio: running(ratio)?,
                        output: running(output)?,
                    })
                }
                _ => Err(format!("not a rule and its figures: {pair:?}")),
            },
            other => Err(format!("not an entry: {other:?}")),
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(CalibrationReply { rules })
}

/// One stored figure, "mean deviation samples", or `None` for "-".
fn running(text: &str) -> Result<Option<RunningFigure>, String> {
    if text == "-" {
        return Ok(None);
    }
    let mut parts = text.split(' ');
    let mut next = || parts.next().ok_or_else(|| format!("short figure {text:?}"));
    let mean = next()?.parse().map_err(|_| format!("bad mean in {text:?}"))?;
    let deviation = next()?.parse().map_err(|_| format!("bad deviation in {text:?}"))?;
    let samples = next()?.parse().map_err(|_| format!("bad samples in {text:?}"))?;
    Ok(Some(RunningFigure { mean, deviation, samples }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(rule: &str, figures: &str) -> Value {
        Value::Array(vec![Value::BulkString(rule.into()), Value::BulkString(figures.into())])
    }

    #[test]
    fn reads_the_stored_figures_exactly() {
        let value = Value::Array(vec![
            entry("00112233aabbccdd", "2.3125 0.5 3|-"),
            entry("ffeeddcc00112233", "-|41.100000000000001 2 20"),
        ]);
        let reply = reply(&value).expect("reply");
        assert_eq!(reply.rules[0].prompt_ratio, Some(RunningFigure { mean: 2.3125, deviation: 0.5, samples: 3 }));
        assert_eq!(reply.rules[0].output, None);
        assert_eq!(reply.rules[1].output.map(|o| (o.mean, o.samples)), Some((41.1, 20)));
    }

    #[test]
    fn a_reply_it_does_not_understand_is_an_error_not_a_guess() {
        assert!(reply(&Value::Array(vec![entry("r", "1 2|-")])).is_err());
        assert!(reply(&Value::Array(vec![entry("r", "no bar")])).is_err());
        assert!(reply(&Value::Int(1)).is_err());
    }
}
