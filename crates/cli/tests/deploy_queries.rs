//! Every PromQL query shipped in deploy/ parses: the Grafana dashboard's (with Grafana's
//! variables given values first) and the alerting rules'. Whether the metrics they name
//! exist is tests/test_filter_metrics.py's part (against a real Envoy scrape).

use serde_json::Value;
use std::path::Path;

fn deploy(path: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy").join(path);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Grafana's variables, as it would substitute them.
fn substitute(query: &str) -> String {
    query.replace("$__rate_interval", "1m").replace("$__range", "6h").replace("$limit", ".*")
}

fn assert_parses(what: &str, query: &str) {
    if let Err(error) = promql_parser::parser::parse(query) {
        panic!("{what}: {query}\n{error}");
    }
}

#[test]
fn the_dashboards_queries_parse() {
    let dashboard: Value = serde_json::from_str(&deploy("grafana/llm-ratelimit.json")).unwrap();
    let mut queries = 0;
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            assert_parses(panel["title"].as_str().unwrap(), &substitute(target["expr"].as_str().unwrap()));
            queries += 1;
        }
    }
    assert!(queries >= 20, "{queries} queries");
}

#[test]
fn the_alerting_rules_parse() {
    let rules: Value = serde_saphyr::from_str(&deploy("prometheus/llm-ratelimit-alerts.yaml")).unwrap();
    let rules = rules["groups"][0]["rules"].as_array().unwrap();
    assert!(!rules.is_empty());
    for rule in rules {
        assert_parses(rule["alert"].as_str().unwrap(), rule["expr"].as_str().unwrap());
    }
    // A query that is not PromQL is refused: the check can fail.
    assert!(promql_parser::parser::parse("sum(rate(x[5m])) >").is_err());
}
