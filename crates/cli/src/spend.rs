//! `llm-ratelimit spend`: the spend ledger over a date range (UTC days), grouped by
//! tenant, a pool's header (`team` for `x-team`), model and day, as a table, JSON or CSV,
//! read through the companion's admin API (`GET /v1/admin/spend`).

use llm_ratelimit_protocol::ledger::{parse_day, SpendReply, SpendRow, SPEND_PATH};
use llm_ratelimit_protocol::TOKEN_HEADER;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Table,
    Json,
    Csv,
}

#[derive(clap::Args)]
pub struct Args {
    /// The first day, `YYYY-MM-DD` (UTC).
    #[arg(long)]
    from: String,
    /// The last day, `YYYY-MM-DD` (UTC), included.
    #[arg(long)]
    to: String,
    /// Group by these, comma-separated: `tenant`, `model`, `day`, or a pool's header (`team`
    /// matches `x-team`); the tenant or one pool at a time. Default: one total row.
    #[arg(long, value_delimiter = ',')]
    by: Vec<String>,
    #[arg(long, value_enum, default_value = "table")]
    format: Format,
    /// The filter's `domain`.
    #[arg(long, default_value = "llm")]
    domain: String,
    /// The companion's base URL.
    #[arg(long, env = "LLMRL_COMPANION_URL", default_value = "http://127.0.0.1:8081")]
    companion: String,
    /// The companion's admin credential. Prefer the environment (LLMRL_ADMIN_TOKEN, or
    /// the variable --admin-token-env names) or --admin-token-file.
    #[arg(long, env = "LLMRL_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// The name of an environment variable holding the admin credential.
    #[arg(long, value_name = "VAR")]
    admin_token_env: Option<String>,
    /// File holding the admin credential (trailing whitespace ignored).
    #[arg(long, env = "LLMRL_ADMIN_TOKEN_FILE", value_name = "FILE")]
    admin_token_file: Option<PathBuf>,
    /// Longest wait for the companion's answer.
    #[arg(long, default_value = "30s", value_parser = llm_ratelimit_protocol::duration::parse_duration)]
    timeout: Duration,
}

fn token(args: &Args) -> Result<String, String> {
    if let Some(var) = &args.admin_token_env {
        return std::env::var(var).map_err(|_| format!("--admin-token-env: {var} is not set"));
    }
    match (&args.admin_token, &args.admin_token_file) {
        (_, Some(path)) => std::fs::read_to_string(path)
            .map(|t| t.trim_end().to_string())
            .map_err(|e| format!("cannot read --admin-token-file {}: {e}", path.display())),
        (Some(token), None) => Ok(token.clone()),
        (None, None) => Err("the companion's admin credential is required: set LLMRL_ADMIN_TOKEN, \
                             --admin-token-env or --admin-token-file"
            .into()),
    }
}

pub fn run(args: &Args) -> Result<(), String> {
    for (flag, day) in [("--from", &args.from), ("--to", &args.to)] {
        if parse_day(day).is_none() {
            return Err(format!("{flag} {day:?} is not a date as YYYY-MM-DD"));
        }
    }
    if !llm_ratelimit_protocol::is_key_part(&args.domain) {
        return Err("--domain must be 1-64 of [A-Za-z0-9_.-]".into());
    }
    if let Some(bad) =
        args.by.iter().find(|d| d.is_empty() || !d.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'))
    {
        return Err(format!("--by: {bad:?} is not a dimension"));
    }
    let token = token(args)?;
    let url = format!(
        "{}{SPEND_PATH}?domain={}&from={}&to={}&by={}",
        args.companion.trim_end_matches('/'),
        args.domain,
        args.from,
        args.to,
        args.by.join(",")
    );
    let config = ureq::Agent::config_builder().http_status_as_error(false).timeout_global(Some(args.timeout)).build();
    let agent = ureq::Agent::new_with_config(config);
    let body = crate::tenant::answer_body(&url, agent.get(&url).header(TOKEN_HEADER, &token).call())?;
    let reply: SpendReply =
        serde_json::from_str(&body).map_err(|e| format!("unexpected answer from the companion: {e}"))?;
    print!("{}", render(&reply, args.format)?);
    Ok(())
}

const COUNTS: [&str; 6] =
    ["requests", "input_tokens", "output_tokens", "cached_tokens", "reasoning_tokens", "cost_micro_usd"];

fn counts(row: &SpendRow) -> [u64; 6] {
    let u = &row.used;
    [u.requests, u.input_tokens, u.output_tokens, u.cached_tokens, u.reasoning_tokens, u.cost_micro_usd]
}

/// Micro-dollars as exact dollars.
fn dollars(micro: u64) -> String {
    format!("${}.{:06}", micro / 1_000_000, micro % 1_000_000)
}

fn csv_cell(text: &str) -> String {
    if text.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text.to_string()
    }
}

fn render(reply: &SpendReply, format: Format) -> Result<String, String> {
    let mut out = String::new();
    match format {
        Format::Json => {
            let rows: Vec<serde_json::Value> = reply
                .rows
                .iter()
                .map(|row| {
                    let mut object = serde_json::Map::new();
                    for (name, value) in &row.keys {
                        object.insert(name.clone(), value.clone().into());
                    }
                    for (name, value) in COUNTS.iter().zip(counts(row)) {
                        object.insert((*name).into(), value.into());
                    }
                    serde_json::Value::Object(object)
                })
                .collect();
            let value = serde_json::json!({"from": reply.from, "to": reply.to, "by": reply.by, "rows": rows});
            out.push_str(&serde_json::to_string_pretty(&value).map_err(|e| e.to_string())?);
            out.push('\n');
        }
        Format::Csv => {
            let header: Vec<String> = reply.by.iter().map(|d| csv_cell(d)).chain(COUNTS.map(String::from)).collect();
            out.push_str(&header.join(","));
            out.push('\n');
            for row in &reply.rows {
                let cells: Vec<String> =
                    row.keys.iter().map(|(_, v)| csv_cell(v)).chain(counts(row).iter().map(u64::to_string)).collect();
                out.push_str(&cells.join(","));
                out.push('\n');
            }
        }
        Format::Table => {
            let header: Vec<String> = reply
                .by
                .iter()
                .cloned()
                .chain(["requests", "input", "output", "cached", "reasoning", "cost"].map(String::from))
                .collect();
            let rows: Vec<Vec<String>> = reply
                .rows
                .iter()
                .map(|row| {
                    let [requests, input, output, cached, reasoning, micro] = counts(row);
                    row.keys
                        .iter()
                        .map(|(_, v)| v.clone())
                        .chain([requests, input, output, cached, reasoning].iter().map(u64::to_string))
                        .chain(std::iter::once(dollars(micro)))
                        .collect()
                })
                .collect();
            let widths = rows.iter().fold(header.iter().map(String::len).collect::<Vec<_>>(), |mut w, row| {
                for (width, cell) in w.iter_mut().zip(row) {
                    *width = (*width).max(cell.chars().count());
                }
                w
            });
            let keys = reply.by.len();
            out.push_str(&format!("spend from {} to {} (UTC days)\n", reply.from, reply.to));
            for cells in std::iter::once(&header).chain(&rows) {
                let line: Vec<String> = cells
                    .iter()
                    .zip(&widths)
                    .enumerate()
                    .map(
                        |(i, (cell, &width))| {
                            if i < keys {
                                format!("{cell:<width$}")
                            } else {
                                format!("{cell:>width$}")
                            }
                        },
                    )
                    .collect();
                out.push_str(line.join("  ").trim_end());
                out.push('\n');
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use llm_ratelimit_protocol::ledger::Spent;

    fn reply() -> SpendReply {
        let used = Spent {
            requests: 3,
            input_tokens: 120,
            output_tokens: 41,
            cached_tokens: 100,
            reasoning_tokens: 12,
            cost_micro_usd: 1_234_567,
        };
        SpendReply {
            from: "2026-11-01".into(),
            to: "2026-11-30".into(),
            by: vec!["team".into(), "model".into()],
            rows: vec![SpendRow {
                keys: vec![("team".into(), "a, \"b\"".into()), ("model".into(), "gpt-4o".into())],
                used,
            }],
        }
    }

    #[test]
    fn the_three_formats_carry_the_exact_figures() {
        let table = render(&reply(), Format::Table).unwrap();
        assert!(table.contains("$1.234567") && table.lines().count() == 3, "{table}");
        let csv = render(&reply(), Format::Csv).unwrap();
        assert_eq!(
            csv,
            "team,model,requests,input_tokens,output_tokens,cached_tokens,reasoning_tokens,cost_micro_usd\n\
             \"a, \"\"b\"\"\",gpt-4o,3,120,41,100,12,1234567\n"
        );
        let json: serde_json::Value = serde_json::from_str(&render(&reply(), Format::Json).unwrap()).unwrap();
        assert_eq!(json["rows"][0]["team"], "a, \"b\"");
        assert_eq!(json["rows"][0]["cost_micro_usd"], 1_234_567);
    }
}
