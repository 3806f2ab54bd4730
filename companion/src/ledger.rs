//! The spend ledger (`LEDGER_PATH`, `SPEND_PATH`): a proxy worker's batch of what its
//! requests used is added per owner by `lua/ledger.lua` (one call per owner, every key
//! under the owner's hash tag, so a Redis Cluster needs no other path), each owner's part
//! at most once (the script's marker of the worker's last batch); then each day's index
//! of owners is updated (SADD, idempotent, so outside the script: a batch resent after a
//! failure there adds its owners again and its rows never twice). An operator's query
//! reads a date range back, grouped as asked.

use crate::store::{Script, Store};
use futures_util::future::try_join_all;
use llm_ratelimit_protocol::keys::{redis_key, LEDGER_INDEX_KIND, LEDGER_INDEX_TENANT, LEDGER_KIND, LEDGER_SEQ_KIND};
use llm_ratelimit_protocol::ledger::{
    days_between, format_day, LedgerBatch, LedgerReply, LedgerRow, SpendReply, SpendRow, Spent, TENANT_LABEL,
};
use redis::Value;
use serde_json::json;
use std::collections::BTreeMap;

pub const SOURCE: &str = include_str!("../../lua/ledger.lua");

/// How long the marker of a worker's last batch lives per owner: a batch resent later
/// than this after it was added (its answer lost, then the companion away all along)
/// would be added again.
pub const MARKER_TTL_S: u64 = 7 * 24 * 3600;

/// How the ledger is kept (the companion's flags).
#[derive(Debug, Clone, Copy)]
pub struct Keeping {
    pub retention_s: u64,
    pub max_models: u64,
}

fn day_key(prefix: &str, domain: &str, owner: &str, day: u32) -> String {
    redis_key(prefix, domain, owner, LEDGER_KIND, &day.to_string())
}

fn index_key(prefix: &str, domain: &str, day: u32) -> String {
    redis_key(prefix, domain, LEDGER_INDEX_TENANT, LEDGER_INDEX_KIND, &day.to_string())
}

/// Adds `batch`: one script call per owner, then the days' indexes.
pub async fn add(
    store: &Store,
    script: &Script,
    prefix: &str,
    keeping: Keeping,
    batch: &LedgerBatch,
) -> Result<LedgerReply, String> {
    // owner -> (label, day -> rows)
    let mut owners: BTreeMap<&str, (&str, BTreeMap<u32, Vec<&LedgerRow>>)> = BTreeMap::new();
    for row in &batch.rows {
        let (_, days) = owners.entry(&row.owner).or_insert((&row.label, BTreeMap::new()));
        days.entry(row.day).or_default().push(row);
    }
    let calls = owners.iter().map(|(owner, (label, days))| {
        let mut keys = vec![redis_key(prefix, &batch.domain, owner, LEDGER_SEQ_KIND, &batch.vm)];
        keys.extend(days.keys().map(|&day| day_key(prefix, &batch.domain, owner, day)));
        let rows: Vec<Vec<serde_json::Value>> = days
            .values()
            .map(|rows| {
                rows.iter()
                    .map(|row| {
                        let mut entry = serde_json::Map::new();
                        entry.insert("model".into(), row.model.clone().into());
                        for (part, value) in row.used.parts() {
                            entry.insert(part.into(), value.into());
                        }
                        serde_json::Value::Object(entry)
                    })
                    .collect()
            })
            .collect();
        let args = json!({
            "seq": batch.seq,
            "marker_ttl_s": MARKER_TTL_S,
            "retention_s": keeping.retention_s,
            "max_models": keeping.max_models,
            "label": label,
            "days": rows,
        })
        .to_string();
        async move {
            let value = store.run(script, &keys, &[&args]).await.map_err(|e| format!("redis: {e}"))?;
            match value {
                Value::Array(items) => match items.first() {
                    Some(Value::Int(1)) => Ok(true),
                    Some(Value::Int(0)) => Ok(false),
                    _ => Err(format!("unexpected script reply {items:?}")),
                },
                other => Err(format!("unexpected script reply {other:?}")),
            }
        }
    });
    let added = try_join_all(calls).await?;
    let mut by_day: BTreeMap<u32, Vec<&str>> = BTreeMap::new();
    for (owner, (_, days)) in &owners {
        for &day in days.keys() {
            by_day.entry(day).or_default().push(owner);
        }
    }
    for (day, members) in by_day {
        let key = index_key(prefix, &batch.domain, day);
        let mut sadd = redis::cmd("SADD");
        sadd.arg(&key).arg(&members);
        store.query(&sadd).await.map_err(|e| format!("redis: {e}"))?;
        store
            .query(redis::cmd("EXPIRE").arg(&key).arg(keeping.retention_s))
            .await
            .map_err(|e| format!("redis: {e}"))?;
    }
    let new = added.iter().filter(|&&a| a).count();
    Ok(LedgerReply { added: new, already: added.len() - new })
}

/// One owner's day as stored.
struct OwnerDay {
    owner: String,
    label: String,
    day: u32,
    models: BTreeMap<String, Spent>,
}

fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

/// An owner-day hash as HGETALL returns it (a flat list or, on RESP3, a map).
fn owner_day(owner: &str, day: u32, value: &Value) -> Result<OwnerDay, String> {
    let pairs: Vec<(String, String)> = match value {
        Value::Array(items) => items
            .chunks(2)
            .map(|pair| match pair {
                [field, value] => Ok((text(field).unwrap_or_default(), text(value).unwrap_or_default())),
                _ => Err("odd HGETALL reply".to_string()),
            })
            .collect::<Result<_, _>>()?,
        Value::Map(items) => {
            items.iter().map(|(f, v)| (text(f).unwrap_or_default(), text(v).unwrap_or_default())).collect()
        }
        other => return Err(format!("unexpected HGETALL reply {other:?}")),
    };
    let mut found = OwnerDay { owner: owner.to_string(), label: String::new(), day, models: BTreeMap::new() };
    for (field, value) in pairs {
        if field == "~label" {
            found.label = value;
            continue;
        }
        if field.starts_with('~') {
            continue;
        }
        let Some((model, part)) = field.rsplit_once('|') else { continue };
        let number: u64 = value.parse().map_err(|_| format!("ledger field {field:?} holds {value:?}"))?;
        found.models.entry(model.to_string()).or_default().set_part(part, number);
    }
    Ok(found)
}

/// A dimension of a spend query.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Dimension {
    Tenant,
    Model,
    Day,
    /// A pool's header: `team` matches the header `team` and `x-team`.
    Pool(String),
}

fn dimensions(by: &[String]) -> Result<Vec<Dimension>, String> {
    let mut dims = Vec::new();
    for name in by {
        let dim = match name.as_str() {
            "tenant" => Dimension::Tenant,
            "model" => Dimension::Model,
            "day" => Dimension::Day,
            other
                if !other.is_empty()
                    && other.len() <= 64
                    && other
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_') =>
            {
                Dimension::Pool(other.to_string())
            }
            other => return Err(format!("unknown dimension {other:?} (tenant, model, day, or a pool's header)")),
        };
        if dims.contains(&dim) {
            return Err(format!("dimension {name:?} given twice"));
        }
        dims.push(dim);
    }
    let pools = dims.iter().filter(|d| matches!(d, Dimension::Pool(_))).count();
    if pools > 1 || (pools == 1 && dims.contains(&Dimension::Tenant)) {
        return Err("group by at most one owner: the tenant or one pool's header (each request is in both)".into());
    }
    Ok(dims)
}

/// The pool value of `label` (`<header>=<value>`) when its header is `dim` or `x-<dim>`.
fn pool_value<'a>(label: &'a str, dim: &str) -> Option<&'a str> {
    let (header, value) = label.split_once('=')?;
    (header == dim || header.strip_prefix("x-") == Some(dim)).then_some(value)
}

/// The rows of `stored` grouped by `by`: by the tenant's rows unless a pool's header is
/// asked for (each request is in its tenant's rows once, and in each of its pools' once).
fn group(stored: &[OwnerDay], dims: &[Dimension]) -> Vec<SpendRow> {
    let pool = dims.iter().find_map(|d| match d {
        Dimension::Pool(name) => Some(name.as_str()),
        _ => None,
    });
    let mut groups: BTreeMap<Vec<String>, Spent> = BTreeMap::new();
    for entry in stored {
        let owner_value = match pool {
            Some(dim) => match pool_value(&entry.label, dim) {
                Some(value) => value.to_string(),
                None => continue,
            },
            None if entry.label == TENANT_LABEL => entry.owner.clone(),
            None => continue,
        };
        for (model, used) in &entry.models {
            let key = dims
                .iter()
                .map(|d| match d {
                    Dimension::Tenant | Dimension::Pool(_) => owner_value.clone(),
                    Dimension::Model => model.clone(),
                    Dimension::Day => format_day(entry.day),
                })
                .collect();
            groups.entry(key).or_default().add(used);
        }
    }
    let names: Vec<String> = dims
        .iter()
        .map(|d| match d {
            Dimension::Tenant => "tenant".to_string(),
            Dimension::Model => "model".to_string(),
            Dimension::Day => "day".to_string(),
            Dimension::Pool(name) => name.clone(),
        })
        .collect();
    groups
        .into_iter()
        .map(|(values, used)| SpendRow { keys: names.iter().cloned().zip(values).collect(), used })
        .collect()
}

/// The ledger of `domain` from `from` to `to` (`YYYYMMDD`), grouped by `by`.
pub async fn spend(
    store: &Store,
    prefix: &str,
    domain: &str,
    from: u32,
    to: u32,
    by: &[String],
) -> Result<SpendReply, (bool, String)> {
    let dims = dimensions(by).map_err(|e| (false, e))?;
    let days = days_between(from, to).map_err(|e| (false, e))?;
    let mut stored = Vec::new();
    for day in days {
        let members = store
            .query(redis::cmd("SMEMBERS").arg(index_key(prefix, domain, day)))
            .await
            .map_err(|e| (true, format!("redis: {e}")))?;
        let owners: Vec<String> = match &members {
            Value::Array(items) | Value::Set(items) => items.iter().filter_map(text).collect(),
            _ => Vec::new(),
        };
        let reads = owners.iter().map(|owner| async move {
            let value = store
                .query(redis::cmd("HGETALL").arg(day_key(prefix, domain, owner, day)))
                .await
                .map_err(|e| (true, format!("redis: {e}")))?;
            owner_day(owner, day, &value).map_err(|e| (true, e))
        });
        stored.extend(try_join_all(reads).await?);
    }
    Ok(SpendReply { from: format_day(from), to: format_day(to), by: by.to_vec(), rows: group(&stored, &dims) })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(owner: &str, label: &str, day: u32, models: &[(&str, u64, u64)]) -> OwnerDay {
        OwnerDay {
            owner: owner.into(),
            label: label.into(),
            day,
            models: models
                .iter()
                .map(|&(m, r, u)| (m.to_string(), Spent { requests: r, cost_micro_usd: u, ..Spent::default() }))
                .collect(),
        }
    }

    #[test]
    fn groups_by_the_owner_asked_for_and_counts_each_request_once() {
        let rows = [
            stored("t1", "tenant", 20_261_101, &[("gpt-4o", 2, 10), ("claude", 1, 5)]),
            stored("t2", "tenant", 20_261_102, &[("gpt-4o", 1, 7)]),
            stored("pa", "x-team=team-a", 20_261_101, &[("gpt-4o", 2, 10), ("claude", 1, 5)]),
            stored("pb", "x-team=team-b", 20_261_102, &[("gpt-4o", 1, 7)]),
        ];
        let dims = dimensions(&["team".into(), "model".into()]).unwrap();
        let by_team = group(&rows, &dims);
        assert_eq!(by_team.len(), 3);
        assert_eq!(by_team[0].keys, [("team".into(), "team-a".into()), ("model".into(), "claude".into())]);
        let by_model = group(&rows, &dimensions(&["model".into()]).unwrap());
        let gpt = by_model.iter().find(|r| r.keys[0].1 == "gpt-4o").unwrap();
        assert_eq!((gpt.used.requests, gpt.used.cost_micro_usd), (3, 17), "the tenants' rows only");
        let total = group(&rows, &[]);
        assert_eq!(total.len(), 1);
        assert_eq!(total[0].used.requests, 4);
        assert!(dimensions(&["tenant".into(), "team".into()]).is_err());
        assert!(dimensions(&["Team".into()]).is_err());
    }

    #[test]
    fn reads_an_owner_day_hash() {
        let flat = Value::Array(
            ["~label", "x-team=a", "~models", "1", "gpt|r", "3", "gpt|u", "12", "a|b|i", "4"]
                .iter()
                .map(|s| Value::BulkString(s.as_bytes().to_vec()))
                .collect(),
        );
        let day = owner_day("p1", 20_261_101, &flat).unwrap();
        assert_eq!(day.label, "x-team=a");
        assert_eq!(day.models["gpt"].requests, 3);
        assert_eq!(day.models["gpt"].cost_micro_usd, 12);
        assert_eq!(day.models["a|b"].input_tokens, 4, "a model with | splits at the last one");
    }
}
