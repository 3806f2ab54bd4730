"""The filter's labelled metrics, end to end: traffic through a real Envoy started from
envoy/demo.yaml (whose `stats_config.stats_tags` is the bootstrap snippet docs/metrics.md
gives), then `/stats/prometheus` scraped from its admin port. Also checks that every
metric the Grafana dashboard queries exists (the filter's against this scrape)."""

import itertools
import json
import re
import time
from pathlib import Path

import pytest
import yaml

import redis

from conftest import openai_chat_prompt_tokens
from helpers import PROMETHEUS_SAMPLE as SAMPLE, envoy_scrape as scrape
from stack import Backend, bucket_level, chat, filter_config_of, free_port, http_get, send, wait_until

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/llm-ratelimit.json"
ALERTS = ROOT / "deploy/prometheus/llm-ratelimit-alerts.yaml"
TOKEN = "metrics-test-token"
BIG_TPM = 1_000_000
LIMITS = [{"name": "rpm", "requests": 3, "window": "1m"}, {"name": "tpm", "tokens": BIG_TPM, "window": "366d"}]  # tpm: refills 0.03 a second, so Redis keeps what was charged

# What Prometheus derives from a histogram's name.
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, frozenset(labels.items()))]


def series_of(samples: dict, name: str) -> list[dict]:
    return [dict(labels) for (n, labels) in samples if n == name]


def scrape_when(admin_port: int, expected: dict) -> dict:
    """Scrapes until every series in `expected` ({(name, labels dict): value}) shows its
    value, or returns the last scrape after 10 s. Each of Envoy's worker VMs hands its
    counts to Envoy on its own 50 ms tick."""
    deadline = time.monotonic() + 10
    while True:
        samples = scrape(admin_port)
        if all(samples.get((name, frozenset(labels))) == value for (name, labels), value in expected.items()):
            return samples
        if time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


def series(name: str, **labels) -> tuple:
    return name, tuple(sorted(labels.items()))


@pytest.fixture(scope="module")
def traffic(module_stack):
    """Four chats from one tenant through an Envoy with rpm = 3 (three admitted, one
    refused), and two through a second Envoy whose companion is unreachable
    (`failure_mode` local: decided in the degraded mode). Returns the replies and scrapes."""
    backend = Backend(module_stack, token=TOKEN)
    admin_port = free_port()
    port = backend.envoy(backend.filter_config(LIMITS), admin_port=admin_port)[0]
    replies = [send(port, key="sk-metrics", body=chat("count my tokens", max_tokens=50)) for _ in range(4)]
    assert [r.status for r in replies] == [200, 200, 200, 429]
    completions = sum(json.loads(r.body)["usage"]["completion_tokens"] for r in replies[:3])
    samples = scrape_when(admin_port, {
        series("llm_ratelimit_decisions_total", limit="rpm", decision="allowed"): 3,
        series("llm_ratelimit_decisions_total", limit="rpm", decision="limited"): 1,
        series("llm_ratelimit_tokens_total", model_rule="gpt-4o", gen_ai_token_type="output",
               token_stage="charged"): completions,
    })

    # Two more Envoys whose companion is unreachable, one per failure mode that admits.
    degraded = {}
    for mode, header in (("local", "local"), ("allow", "companion-unavailable")):
        degraded_admin = free_port()
        degraded_config = backend.filter_config(LIMITS, failure_mode=mode, companion_timeout="100ms")
        degraded_port = backend.envoy(degraded_config, name=f"envoy-degraded-{mode}", companion_port=free_port(),
                                      admin_port=degraded_admin)[0]
        degraded_replies = [send(degraded_port, key="sk-metrics-degraded") for _ in range(2)]
        assert [r.status for r in degraded_replies] == [200, 200]
        assert all(r.headers.get("x-llm-ratelimit-degraded") == header for r in degraded_replies)
        degraded[mode] = scrape_when(degraded_admin, {
            series("llm_ratelimit_decisions_total", limit="rpm", decision="degraded"): 2,
            series("llm_ratelimit_degraded_decisions_total"): 2})
    companion = http_get(f"http://127.0.0.1:{backend.companion_port}/metrics")[1].decode()
    companion_names = {m.group(1) for line in companion.splitlines() if (m := SAMPLE.match(line))}
    assert companion_names
    return {"replies": replies, "samples": samples, "degraded": degraded, "admin_port": admin_port, "port": port,
            "companion_names": companion_names, "backend": backend}


def test_decisions_are_labelled_by_limit_and_decision(traffic):
    samples = traffic["samples"]
    decisions = "llm_ratelimit_decisions_total"
    assert value(samples, decisions, limit="rpm", decision="allowed") == 3
    assert value(samples, decisions, limit="rpm", decision="limited") == 1, "rpm refused the fourth"
    assert value(samples, decisions, limit="tpm", decision="allowed") == 3
    assert value(samples, decisions, limit="tpm", decision="limited") == 0, "tpm had room"
    for limit in ("rpm", "tpm"):
        assert value(samples, decisions, limit=limit, decision="degraded") == 0
        assert value(samples, decisions, limit=limit, decision="shadow") == 0
        assert value(samples, decisions, limit=limit, decision="overflowed") == 0
    # Exactly the config's limits and the five decisions: nothing a client can add to.
    assert sorted((s["limit"], s["decision"]) for s in series_of(samples, decisions)) == sorted(
        (limit, decision) for limit in ("rpm", "tpm") for decision in ("allowed", "limited", "degraded", "shadow", "overflowed"))
    # The unlabelled counters, per request whatever the limit.
    assert value(samples, "llm_ratelimit_requests_allowed_total") == 3
    assert value(samples, "llm_ratelimit_requests_limited_total") == 1
    assert value(samples, "llm_ratelimit_degraded_decisions_total") == 0

    for mode, degraded in traffic["degraded"].items():
        assert value(degraded, decisions, limit="rpm", decision="degraded") == 2, mode
        assert value(degraded, decisions, limit="rpm", decision="allowed") == 0, mode
        # What the dashboard's "Time in degraded mode" counts, in every failure mode.
        assert value(degraded, "llm_ratelimit_degraded_decisions_total") == 2, mode
        assert value(degraded, "llm_ratelimit_callout_failures_total") >= 1, mode


def test_tokens_are_labelled_by_gen_ai_token_type_and_stage(traffic, tiktoken_encodings):
    samples, admitted = traffic["samples"], traffic["replies"][:3]
    tokens = lambda kind, stage: value(samples, "llm_ratelimit_tokens_total", model_rule="gpt-4o",  # noqa: E731
                                       gen_ai_token_type=kind, token_stage=stage)
    usages = [json.loads(r.body)["usage"] for r in admitted]
    assert tokens("input", "charged") == sum(u["prompt_tokens"] for u in usages)
    assert tokens("output", "charged") == sum(u["completion_tokens"] for u in usages)
    # The prompts reserved are OpenAI's count of them (tiktoken; the mock reports fewer, so
    # the factor learned stays at its floor of 1).
    prompt = openai_chat_prompt_tokens(tiktoken_encodings["o200k_base"], [{"role": "user", "content": "count my tokens"}])
    assert tokens("input", "reserved") == 3 * prompt
    # What was charged is what Redis holds: the settled usage, and nothing else.
    charged = tokens("input", "charged") + tokens("output", "charged")
    store = redis.Redis(port=traffic["backend"].redis_port)
    wait_until(lambda: abs(BIG_TPM - bucket_level(store, "sk-metrics", "tpm") - charged) < 1, 15,
               f"Redis charged {charged}")
    reserved = sum(int(r.headers["x-llm-ratelimit-reserved-tokens"]) for r in admitted)
    assert tokens("input", "reserved") + tokens("output", "reserved") == reserved
    assert tokens("input", "reserved") > 0 and tokens("output", "reserved") > 0
    assert value(samples, "llm_ratelimit_tokens_reserved_total") == reserved
    # gpt-4o-mini is the gpt-4o rule's: no other rule counted anything.
    others = [s for s in series_of(samples, "llm_ratelimit_tokens_total") if s["model_rule"] != "gpt-4o"]
    assert others and all(value(samples, "llm_ratelimit_tokens_total", **s) == 0 for s in others)


def test_each_learned_figure_is_one_labelled_gauge(traffic):
    """prompt_factor and output_prior: one series per model rule, labelled, and nothing
    else under those names (they were also exported as `prompt_factor_<rule>` before)."""
    samples = traffic["samples"]
    rules = [s["model_rule"] for s in series_of(samples, "llm_ratelimit_prompt_factor_thousandths")]
    # One per model rule: the same rules the token counters have.
    assert sorted(rules) == sorted({s["model_rule"] for s in series_of(samples, "llm_ratelimit_tokens_total")})
    assert sorted(rules) == sorted(s["model_rule"] for s in series_of(samples, "llm_ratelimit_output_prior_tokens"))
    assert value(samples, "llm_ratelimit_prompt_factor_thousandths", model_rule="other") == 1000, \
        "a rule without replies keeps its configured factor"
    # A rule's label is its pattern without the wildcard: OpenAI's gpt-3.5* and gpt-4.1*
    # as written (docs/metrics.md); Azure's gpt-35* is the gpt-3.5 family, no label of its own.
    assert {"gpt-4o", "gpt-4.1", "gpt-3.5", "other"} <= set(rules), rules
    assert not any(rule.startswith("gpt-35") for rule in rules), rules
    gauges = {name for name, _ in samples if re.search(r"prompt_factor|output_prior|lease_bound", name)}
    assert gauges == {"llm_ratelimit_prompt_factor_thousandths", "llm_ratelimit_output_prior_tokens"}, gauges


def test_openais_and_azures_gpt_35_are_one_family_under_one_label(traffic, tiktoken_encodings):
    """OpenAI names the model `gpt-3.5-turbo`, Azure `gpt-35-turbo`: one family, so both
    requests count under `model_rule="gpt-3.5"` (docs/metrics.md), at cl100k_base's count."""
    port, admin_port = traffic["port"], traffic["admin_port"]
    before = scrape(admin_port)
    reserved = series("llm_ratelimit_tokens_total", model_rule="gpt-3.5", gen_ai_token_type="input",
                      token_stage="reserved")
    already = before.get((reserved[0], frozenset(reserved[1])), 0)
    models = ["gpt-3.5-turbo", "gpt-35-turbo"]
    replies = [send(port, key="sk-metrics-gpt-35", body=chat("count my tokens", model=model, max_tokens=50))
               for model in models]
    assert [r.status for r in replies] == [200, 200], [r.body for r in replies]
    prompt = openai_chat_prompt_tokens(tiktoken_encodings["cl100k_base"], [{"role": "user", "content": "count my tokens"}])
    samples = scrape_when(admin_port, {reserved: already + 2 * prompt})
    assert value(samples, "llm_ratelimit_tokens_total", model_rule="gpt-3.5", gen_ai_token_type="input",
                 token_stage="reserved") == already + 2 * prompt
    labels = {s["model_rule"] for s in series_of(samples, "llm_ratelimit_tokens_total")}
    assert "gpt-3.5" in labels and not any(label.startswith("gpt-35") for label in labels), labels


def metric_types(admin_port: int) -> dict:
    """The `# TYPE` lines of `/stats/prometheus`: {name: type}."""
    body = http_get(f"http://127.0.0.1:{admin_port}/stats/prometheus", timeout=10)[1].decode()
    return {m.group(1): m.group(2) for m in re.finditer(r"^# TYPE (\S+) (\S+)$", body, re.M)}


def test_the_filters_metrics_follow_prometheus_naming(traffic):
    """Counters end in `_total`, no unit but seconds, and no name the companion's prefix
    would claim. Expected from Prometheus's naming guide, not from the filter."""
    types = {name: kind for name, kind in metric_types(traffic["admin_port"]).items() if name.startswith("llm_ratelimit")}
    assert len(types) >= 20, sorted(types)
    for name, kind in types.items():
        assert not name.startswith("llm_ratelimit_companion_"), f"{name}: reads as the companion's"
        assert not re.search(r"_(ms|milliseconds|microseconds|us)(_|$)", name), f"{name}: not in seconds"
        if kind == "counter":
            assert name.endswith("_total"), name
        else:
            assert kind == "gauge" and not name.endswith("_total"), (name, kind)
    assert "llm_ratelimit_queue_wait_seconds_total" in types


METRICS_DOC = ROOT / "docs/metrics.md"
TROUBLESHOOTING_DOC = ROOT / "docs/troubleshooting.md"


def readme_table(heading: str) -> list[list[str]]:
    """The body rows of the first table under docs/metrics.md's `heading`, each a list of cells."""
    section = METRICS_DOC.read_text().split(f"\n{heading}\n", 1)[1]
    table = list(itertools.takewhile(lambda line: line.startswith("|"), section[section.index("\n|") + 1:].split("\n")))
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in table[2:]]


def first_name(cell: str) -> str:
    """The metric name a cell starts with (`llm_ratelimit_lease_bound{limit}` -> its name)."""
    return re.match(r"`(llm_ratelimit_[a-z0-9_]+)", cell).group(1)


def readme_metrics() -> list[tuple[str, str]]:
    """(name, type) of every row of docs/metrics.md's "All counters and gauges", then of the
    labelled families of "Labelled" (which that table says are listed there)."""
    listed = [(first_name(name), kind) for name, kind, _ in readme_table("### All counters and gauges")]
    return listed + [(first_name(name), "gauge" if counts.startswith("Gauge") else "counter")
                     for name, _, counts in readme_table("### Labelled: decisions per limit, tokens by kind")]


@pytest.fixture(scope="module")
def scraped_types(traffic):
    """The filter's `# TYPE` lines of the traffic Envoy and of one more in lease mode (the
    only mode with `lease_bound`), once every name docs/metrics.md lists shows (10 s at most)."""
    backend = traffic["backend"]
    lease_admin = free_port()
    lease_port = backend.envoy(backend.filter_config(LIMITS, lease={"enabled": True}), name="envoy-lease",
                               admin_port=lease_admin)[0]
    assert send(lease_port, key="sk-metrics-lease").status == 200
    listed = {name for name, _ in readme_metrics()}
    deadline = time.monotonic() + 10
    while not listed <= set(types := {**metric_types(traffic["admin_port"]), **metric_types(lease_admin)}) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    return {name: kind for name, kind in types.items() if name.startswith("llm_ratelimit_")}, lease_admin


def test_every_metric_the_readme_lists_is_scraped_with_its_type_and_no_other(traffic, scraped_types):
    """docs/metrics.md "All counters and gauges" (with the labelled families): each name in a real
    Envoy's `/stats/prometheus` with the type and the labels the table states, and no
    other `llm_ratelimit_*` name."""
    types, lease_admin = scraped_types
    listed = readme_metrics()
    assert len(listed) >= 20, listed
    assert [(name, types.get(name)) for name, _ in listed] == listed
    assert sorted(set(types) - {name for name, _ in listed}) == [], "scraped, but not in docs/metrics.md's table"
    samples = {**traffic["samples"], **scrape(lease_admin)}
    for cell, _, _ in readme_table("### All counters and gauges"):
        stated = set(re.findall(r"[a-z_]+", cell.split("{")[1])) if "{" in cell else set()
        found = series_of(samples, first_name(cell))
        assert found and all(set(labels) == stated for labels in found), (cell, found)


def test_the_upgrade_tables_new_names_are_scraped_and_its_old_ones_are_gone(traffic, scraped_types):
    """docs/metrics.md "Upgrading: metric names": every right-hand name is scraped, no left-hand
    one is (a `<limit>` or `<rule>` in it stands for each of the config's limits and
    rules, the rule also as the old names spelt it, `.` as `_`); and `/stats` has
    `wasmcustom.llm_ratelimit_<name>_total`, never `wasmcustom.llm_ratelimit.<name>`."""
    types, lease_admin = scraped_types
    rows = [(old, new) for old, new in readme_table("### Upgrading: metric names") if old.startswith("`llm_ratelimit_")]
    assert len(rows) >= 19, rows
    assert sorted({first_name(new) for _, new in rows} - set(types)) == []
    rules = {s["model_rule"] for s in series_of(traffic["samples"], "llm_ratelimit_tokens_total")}
    stand_ins = {"<limit>": [limit["name"] for limit in LIMITS], "<rule>": rules | {r.replace(".", "_") for r in rules}}
    old_names = set()
    for old, _ in rows:
        name = old.strip("`")
        placeholder = next((p for p in stand_ins if p in name), None)
        old_names |= {name.replace(placeholder, value) for value in stand_ins[placeholder]} if placeholder else {name}
    scraped = {name for name, _ in traffic["samples"]} | set(types)
    assert sorted(old_names & scraped) == []
    for admin in (traffic["admin_port"], lease_admin):
        stats = http_get(f"http://127.0.0.1:{admin}/stats?filter=llm_ratelimit", timeout=5)[1].decode()
        assert "wasmcustom.llm_ratelimit." not in stats
        assert "wasmcustom.llm_ratelimit_requests_allowed_total: " in stats


def test_the_readmes_bootstrap_snippet_is_the_demos():
    """docs/metrics.md's stats_tags block is the one envoy/demo.yaml (and so every test) runs."""
    readme = METRICS_DOC.read_text()
    block = readme.split("<!-- stats-tags -->", 1)[1].split("```yaml", 1)[1].split("```", 1)[0]
    demo = yaml.safe_load((ROOT / "envoy/demo.yaml").read_text())
    assert yaml.safe_load(block) == {"stats_config": demo["stats_config"]}


def test_no_label_carries_a_tenant_or_a_key(traffic):
    tenant_like = re.compile(r"[0-9a-f]{32}|sk-")
    for name, labels in traffic["samples"]:
        if name.startswith("llm_ratelimit"):
            assert not any(tenant_like.search(v) for _, v in labels), (name, labels)


# docs/metrics.md: "5 counters per limit, 4 counters and 2 gauges per model rule, a gauge
# per limit in lease mode: 111 for the demo's three limits and the 15 built-in rules and
# catch-all, whatever the traffic".
LABELLED = ("llm_ratelimit_decisions_total", "llm_ratelimit_tokens_total", "llm_ratelimit_lease_bound",
            "llm_ratelimit_prompt_factor_thousandths", "llm_ratelimit_output_prior_tokens")
BUILT_IN_RULES_AND_CATCH_ALL = 15 + 1


def labelled_series(samples: dict) -> set:
    return {(name, labels) for name, labels in samples if name in LABELLED}


def test_the_labelled_series_are_fixed_by_the_config(traffic):
    """The number of labelled series is docs/metrics.md's arithmetic over the config (this
    one: two limits, no lease, no rule of its own), and traffic that invents tenants and
    models adds none."""
    before = labelled_series(traffic["samples"])
    rules = {dict(labels)["model_rule"] for name, labels in before if name == "llm_ratelimit_tokens_total"}
    assert len(rules) == BUILT_IN_RULES_AND_CATCH_ALL, sorted(rules)
    assert len(before) == 5 * len(LIMITS) + (4 + 2) * BUILT_IN_RULES_AND_CATCH_ALL, sorted(before)
    demo_limits = filter_config_of(yaml.safe_load((ROOT / "envoy/demo.yaml").read_text()))["limits"]
    assert 5 * len(demo_limits) + (4 + 2) * BUILT_IN_RULES_AND_CATCH_ALL == 111, "docs/metrics.md's figure for the demo"
    # New tenants asking for models no rule names, and one rule's variants: admitted and
    # settled, counted under the catch-all or their rule, never as series of their own.
    for i, model in enumerate(["invented-model-1", "invented-model-2", "gpt-4o-2099-01-01", "claude-made-up"]):
        assert send(traffic["port"], key=f"sk-metrics-new-{i}", body=chat("hi", model=model, max_tokens=5)).status == 200
    other = series("llm_ratelimit_tokens_total", model_rule="other", gen_ai_token_type="input", token_stage="reserved")
    deadline = time.monotonic() + 10
    while True:
        after = scrape(traffic["admin_port"])
        reserved_other = after.get((other[0], frozenset(other[1])), 0)
        if reserved_other > value(traffic["samples"], other[0], **dict(other[1])) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert reserved_other > value(traffic["samples"], other[0], **dict(other[1])), "the new models were counted"
    assert labelled_series(after) == before


def queried_metrics() -> set[str]:
    """Every metric name the PromQL of deploy/ mentions: the dashboard's panels and
    variables, the alerting rules. (crates/cli/tests/deploy_queries.rs parses them.)"""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    alerts = [rule["expr"] for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]
    assert queries and alerts
    return {name for query in queries + alerts for name in re.findall(r"\bllm_ratelimit_[a-z0-9_]+", query)}


def family(name: str) -> str:
    """The metric a sample name belongs to (a histogram's series to the histogram)."""
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def test_every_metric_the_dashboard_and_alerts_query_exists(traffic):
    names = queried_metrics()
    # A name is the companion's if its /metrics has it; every other must be Envoy's.
    companion_scraped = traffic["companion_names"]
    companion = names & companion_scraped
    filter_names = names - companion
    scraped = {name for name, _ in traffic["samples"]}
    assert filter_names and filter_names <= scraped, sorted(filter_names - scraped)
    shown = {family(n) for n in companion}
    assert shown == {family(n) for n in companion_scraped}, "every companion metric is shown"


def test_every_alert_is_per_instance_with_a_runbook_into_troubleshooting():
    """Each alert says which proxy or companion (`by (instance)`), and links to a
    Troubleshooting entry that exists."""
    troubleshooting = TROUBLESHOOTING_DOC.read_text()
    anchors = set(re.findall(r'<a id="([a-z0-9-]+)"></a>', troubleshooting))
    rules = [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]
    assert len(rules) >= 10
    for rule in rules:
        assert "instance" in rule["expr"] and "by (instance" in rule["expr"], rule["alert"]
        url = rule["annotations"]["runbook_url"]
        assert url.startswith("docs/troubleshooting.md#"), (rule["alert"], url)
        anchor = url.split("#", 1)[1]
        assert anchor in anchors and f'<a id="{anchor}">' in troubleshooting, (rule["alert"], anchor)
