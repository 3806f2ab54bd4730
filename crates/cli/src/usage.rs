//! `llm-ratelimit usage`: where a tenant stands on each limit, as a table or as JSON.

use crate::tenant::TenantArgs;
use llm_ratelimit_core::config::{Dimension, Policy};
use llm_ratelimit_core::replies::decision::usd;
use llm_ratelimit_protocol::duration::format_reset;
use llm_ratelimit_protocol::{LimitUsage, UsageReply, USAGE_PATH};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    tenant: TenantArgs,
    /// Print the companion's answer as JSON (one object, `limits` in policy order).
    #[arg(long)]
    json: bool,
}

pub fn run(args: &Args) -> Result<(), String> {
    let resolved = args.tenant.resolve()?;
    let usage: UsageReply = args.tenant.call(&resolved, USAGE_PATH)?;
    let now_ms = crate::tenant::now_ms();
    if args.json {
        println!("{}", as_json(&resolved.policy, &usage, &resolved.request.tenant, &resolved.request.domain, now_ms)?);
    } else {
        println!("tenant {} in domain {}", resolved.request.tenant, resolved.request.domain);
        print!("{}", table(&resolved.policy, &usage, now_ms));
        let at_least = if usage.reservations_complete { "" } else { "at least " };
        println!("reservations awaiting settlement: {at_least}{}", usage.reservations);
    }
    Ok(())
}

/// The companion's answer as docs/operating.md lists it (`--json`): every limit with its `kind` (the wire
/// leaves out the default, a token bucket), the limit that binds marked (`binding`), a
/// calendar budget's `resets_at` (the local time of its period's end, RFC 3339 with the
/// zone's offset), and the tenant and domain asked about.
fn as_json(
    policy: &Policy,
    usage: &UsageReply,
    tenant: &str,
    domain: &str,
    now_ms: u64,
) -> Result<serde_json::Value, String> {
    let mut value = serde_json::to_value(usage).map_err(|e| e.to_string())?;
    let binding = binding(&usage.limits);
    if let Some(object) = value.as_object_mut() {
        if let Some(limits) = object.get_mut("limits").and_then(serde_json::Value::as_array_mut) {
            for (index, (json, limit)) in limits.iter_mut().zip(&usage.limits).enumerate() {
                if let Some(entry) = json.as_object_mut() {
                    entry.insert("kind".into(), serde_json::to_value(limit.kind).map_err(|e| e.to_string())?);
                    entry.insert("binding".into(), (Some(index) == binding).into());
                    if let Some(calendar) = policy.limit(&limit.name).and_then(|l| l.calendar.as_ref()) {
                        let at = calendar.rfc3339(now_ms.saturating_add(limit.reset_after_ms));
                        entry.insert("resets_at".into(), at.into());
                    }
                }
            }
        }
        let name = binding.and_then(|i| usage.limits.get(i)).map(|l| l.name.clone());
        object.insert("binding".into(), name.into());
        object.insert("tenant".into(), tenant.into());
        object.insert("domain".into(), domain.into());
    }
    Ok(value)
}

/// The limit that decides when the tenant is refused: of those with nothing left, the one
/// that frees up last (the one a 429 would name); else the one with the smallest share
/// left. `None` for no limits.
fn binding(limits: &[LimitUsage]) -> Option<usize> {
    let exhausted = limits.iter().enumerate().filter(|(_, l)| l.remaining == 0).max_by_key(|(_, l)| l.retry_after_ms);
    exhausted.map(|(i, _)| i).or_else(|| {
        let share = |l: &LimitUsage| l.remaining as f64 / l.limit.max(1) as f64;
        limits.iter().enumerate().min_by(|(_, a), (_, b)| share(a).total_cmp(&share(b))).map(|(i, _)| i)
    })
}

/// One row per limit: what it counts, how much is used and left, when it is full again
/// (a calendar budget: when its period ends, and that local time) and when one more fits.
fn table(policy: &Policy, usage: &UsageReply, now_ms: u64) -> String {
    let header = ["limit", "counts", "used", "remaining", "of", "full in", "next fits in"].map(String::from);
    let rows: Vec<[String; 7]> = usage.limits.iter().map(|l| row(policy, l, now_ms)).collect();
    // Each column as wide as its widest cell, the header's included.
    let widths = rows.iter().fold(header.clone().map(|cell| cell.len()), |mut widths, row| {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.len());
        }
        widths
    });
    let mut text = String::new();
    for cells in std::iter::once(&header).chain(&rows) {
        let line: Vec<String> = cells
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(i, (cell, width))| if i < 2 { format!("{cell:<width$}") } else { format!("{cell:>width$}") })
            .collect();
        text.push_str(line.join("  ").trim_end());
        text.push('\n');
    }
    text
}

fn row(policy: &Policy, limit: &LimitUsage, now_ms: u64) -> [String; 7] {
    let configured = policy.limit(&limit.name);
    let dimension = configured.map(|l| l.dimension());
    let calendar = configured.and_then(|l| l.calendar.as_ref());
    let amount = |n: u64| match dimension {
        Some(Dimension::Cost) => usd(n),
        _ => n.to_string(),
    };
    let counts = match dimension {
        Some(Dimension::Concurrency) => "in flight".to_string(),
        Some(other) => match calendar {
            Some(calendar) => format!("{} ({})", other.name(), calendar.describe()),
            None => format!("{} ({})", other.name(), window_name(limit)),
        },
        None => String::new(),
    };
    let next = if limit.remaining > 0 { "now".to_string() } else { format_reset(limit.retry_after_ms) };
    [
        limit.name.clone(),
        counts,
        amount(limit.used),
        amount(limit.remaining),
        amount(limit.limit),
        match calendar {
            Some(calendar) => format!(
                "{} (at {})",
                format_reset(limit.reset_after_ms),
                calendar.local_time(now_ms.saturating_add(limit.reset_after_ms))
            ),
            None => format_reset(limit.reset_after_ms),
        },
        next,
    ]
}

fn window_name(limit: &LimitUsage) -> &'static str {
    match limit.kind {
        llm_ratelimit_protocol::LimitKind::SlidingWindow => "sliding window",
        _ => "token bucket",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use llm_ratelimit_protocol::LimitKind;

    #[test]
    fn the_table_names_each_limit_in_its_own_unit() {
        let policy = Policy::from_json(
            br#"{"companion": {"upstream": "c", "token": "test-token-0123456789"},
                 "limits": [{"name": "rpm", "requests": 20, "window": "1m"},
                            {"name": "budget", "usd": 5, "window": "1d", "algorithm": "sliding_window"},
                            {"name": "inflight", "concurrency": 2}],
                 "prices": [{"match": "*", "input": 1, "output": 1}]}"#,
        )
        .expect("valid config");
        let usage = |name: &str, kind, limit, remaining, reset_after_ms, retry_after_ms| LimitUsage {
            name: name.into(),
            kind,
            limit,
            remaining,
            used: limit - remaining,
            reset_after_ms,
            retry_after_ms,
        };
        let reply = UsageReply {
            limits: vec![
                usage("rpm", LimitKind::TokenBucket, 20, 0, 60_000, 3_000),
                usage("budget", LimitKind::SlidingWindow, 5_000_000, 4_998_750, 86_000_000, 0),
                usage("inflight", LimitKind::Slots, 2, 1, 0, 0),
            ],
            reservations: 0,
            reservations_complete: true,
        };
        let text = table(&policy, &reply, 0);
        // Cells are separated by two spaces at least; a cell holds single spaces only.
        let rows: Vec<Vec<&str>> =
            text.lines().map(|line| line.split("  ").map(str::trim).filter(|c| !c.is_empty()).collect()).collect();
        assert_eq!(rows[0], ["limit", "counts", "used", "remaining", "of", "full in", "next fits in"], "{text}");
        assert_eq!(rows[1], ["rpm", "requests (token bucket)", "20", "0", "20", "1m0s", "3s"], "{text}");
        assert_eq!(rows[2], ["budget", "cost (sliding window)", "$0.00125", "$5.00", "$5.00", "23h53m20s", "now"]);
        assert_eq!(rows[3], ["inflight", "in flight", "1", "1", "2", "0s", "now"], "{text}");
        assert_eq!(rows.len(), 4);

        // JSON: every limit's kind, the token bucket's too, and the binding limit marked.
        let json = as_json(&policy, &reply, "t1", "llm", 0).unwrap();
        let kinds: Vec<&str> = json["limits"].as_array().unwrap().iter().map(|l| l["kind"].as_str().unwrap()).collect();
        assert_eq!(kinds.len(), 3);
        assert!(kinds.iter().all(|k| !k.is_empty()), "{json}");
        assert_eq!(json["limits"][0]["kind"], serde_json::to_value(LimitKind::TokenBucket).unwrap());
        assert_eq!(json["binding"], "rpm", "rpm has nothing left: {json}");
        let marked: Vec<bool> = json["limits"].as_array().unwrap().iter().map(|l| l["binding"] == true).collect();
        assert_eq!(marked, [true, false, false]);
    }

    #[test]
    fn with_room_everywhere_the_smallest_share_left_binds() {
        let usage = |name: &str, limit: u64, remaining: u64| LimitUsage {
            name: name.into(),
            kind: LimitKind::TokenBucket,
            limit,
            remaining,
            used: limit - remaining,
            reset_after_ms: 1,
            retry_after_ms: 0,
        };
        // 5 of 20 left (25%) binds before 4,000 of 10,000 (40%).
        assert_eq!(binding(&[usage("tpm", 10_000, 4_000), usage("rpm", 20, 5)]), Some(1));
        assert_eq!(binding(&[]), None);
    }
}
