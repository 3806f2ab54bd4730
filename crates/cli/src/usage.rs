//! `llm-ratelimit usage`: where a tenant stands on each limit, as a table or as JSON.

use crate::tenant::TenantArgs;
use llm_ratelimit_core::config::{Dimension, Policy};
use llm_ratelimit_core::decision::usd;
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
    if args.json {
        let mut value = serde_json::to_value(&usage).map_err(|e| e.to_string())?;
        if let Some(object) = value.as_object_mut() {
            object.insert("tenant".into(), resolved.request.tenant.clone().into());
            object.insert("domain".into(), resolved.request.domain.clone().into());
        }
        println!("{value}");
    } else {
        println!("tenant {} in domain {}", resolved.request.tenant, resolved.request.domain);
        print!("{}", table(&resolved.policy, &usage));
        let at_least = if usage.reservations_complete { "" } else { "at least " };
        println!("reservations awaiting settlement: {at_least}{}", usage.reservations);
    }
    Ok(())
}

/// One row per limit: what it counts, how much is used and left, when it is full again
/// and when one more fits.
fn table(policy: &Policy, usage: &UsageReply) -> String {
    let header = ["limit", "counts", "used", "remaining", "of", "full in", "next fits in"].map(String::from);
    let rows: Vec<[String; 7]> = usage.limits.iter().map(|l| row(policy, l)).collect();
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

fn row(policy: &Policy, limit: &LimitUsage) -> [String; 7] {
    let dimension = policy.limit(&limit.name).map(|l| l.dimension());
    let amount = |n: u64| match dimension {
        Some(Dimension::Cost) => usd(n),
        _ => n.to_string(),
    };
    let counts = match dimension {
        Some(Dimension::Concurrency) => "in flight".to_string(),
        Some(other) => format!("{} ({})", other.name(), window_name(limit)),
        None => String::new(),
    };
    let next = if limit.remaining > 0 { "now".to_string() } else { format_reset(limit.retry_after_ms) };
    [
        limit.name.clone(),
        counts,
        amount(limit.used),
        amount(limit.remaining),
        amount(limit.limit),
        format_reset(limit.reset_after_ms),
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
        let text = table(&policy, &reply);
        // Cells are separated by two spaces at least; a cell holds single spaces only.
        let rows: Vec<Vec<&str>> =
            text.lines().map(|line| line.split("  ").map(str::trim).filter(|c| !c.is_empty()).collect()).collect();
        assert_eq!(rows[0], ["limit", "counts", "used", "remaining", "of", "full in", "next fits in"], "{text}");
        assert_eq!(rows[1], ["rpm", "requests (token bucket)", "20", "0", "20", "1m0s", "3s"], "{text}");
        assert_eq!(rows[2], ["budget", "cost (sliding window)", "$0.00125", "$5.00", "$5.00", "23h53m20s", "now"]);
        assert_eq!(rows[3], ["inflight", "in flight", "1", "1", "2", "0s", "now"], "{text}");
        assert_eq!(rows.len(), 4);
    }
}
