//! Every PromQL query shipped in deploy/ parses: the Grafana dashboard's (with Grafana's
//! variables given values first) and the alerting rules'. Whether the metrics they name
//! exist is tests/e2e/test_filter_metrics.py's part (against a real Envoy scrape).

use serde_json::Value;
use std::path::Path;

fn deploy(path: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy").join(path);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Grafana's variables, as it would substitute them (every query variable at "All").
fn substitute(query: &str) -> String {
    let query = query.replace("$__rate_interval", "1m").replace("$__range", "6h");
    ["$limit", "$instance", "$companion", "$cluster", "$namespace"].iter().fold(query, |q, v| q.replace(v, ".*"))
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
    let variables = dashboard["templating"]["list"].as_array().unwrap();
    for variable in variables.iter().filter(|v| v["definition"].is_string()) {
        let definition = variable["definition"].as_str().unwrap();
        // label_values(<selector>, <label>): the selector is PromQL.
        let selector = definition.strip_prefix("label_values(").and_then(|d| d.rsplit_once(',')).map(|(s, _)| s);
        assert_parses(variable["name"].as_str().unwrap(), &substitute(selector.expect(definition)));
    }
}

#[test]
fn every_filter_panel_can_be_narrowed_to_one_proxy() {
    let dashboard: Value = serde_json::from_str(&deploy("grafana/llm-ratelimit.json")).unwrap();
    let names: Vec<&str> =
        dashboard["templating"]["list"].as_array().unwrap().iter().filter_map(|v| v["name"].as_str()).collect();
    for variable in ["cluster", "namespace", "instance", "companion"] {
        assert!(names.contains(&variable), "{variable}: {names:?}");
    }
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().unwrap();
            let instances = if expr.contains("llm_ratelimit_companion_") { "$companion" } else { "$instance" };
            assert!(expr.contains(&format!("instance=~\"{instances}\"")), "{}: {expr}", panel["title"]);
        }
    }
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
