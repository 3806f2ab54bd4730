"""lua/calibration.lua against a real redis-server, with the case table that the Rust
model (crates/core/src/accounting/calibration.rs, Running::observe) is tested with; and on a
three-node Redis Cluster."""

import json
from pathlib import Path

import pytest
import redis

from stack import redis_key

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = (ROOT / "lua/calibration.lua").read_text()
CASES = json.loads((ROOT / "tests/cases/calibration.json").read_text())["cases"]
KEY = redis_key("llmrl:", "llm", "models", "cal", "rules")
RULE, OTHER = "00112233aabbccdd", "ffeeddcc00112233"


@pytest.fixture(scope="module")
def client(module_stack):
    _, port = module_stack.redis()
    return redis.Redis(port=port)


def exchange(client, rules, window=20, ttl_ms=60_000, key=KEY):
    reply = client.eval(SCRIPT, 1, key, json.dumps({"window": window, "ttl_ms": ttl_ms, "rules": rules}))
    return {rule.decode(): figures.decode() for rule, figures in reply}


def figures(text):
    """One stored figure, "mean deviation samples", or None for "-"."""
    if text == "-":
        return None
    mean, deviation, samples = text.split()
    return float(mean), float(deviation), int(samples)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"w{c['window']}-{len(c['samples'])}")
def test_running_figures_as_the_rust_model_computes_them(client, case):
    client.delete(KEY)
    # Taken in over two exchanges: the stored form carries the figures exactly.
    half = len(case["samples"]) // 2
    exchange(client, [{"rule": RULE, "prompt_ratios": case["samples"][:half]}], window=case["window"])
    got = exchange(client, [{"rule": RULE, "outputs": case["samples"], "prompt_ratios": case["samples"][half:]}],
                   window=case["window"])
    ratio, output = (figures(part) for part in got[RULE].split("|"))
    for mean, deviation, samples in (ratio, output):
        assert samples == case["count"]
        assert mean == pytest.approx(case["mean"], abs=1e-9)
        assert deviation == pytest.approx(case["deviation"], abs=1e-9)


def test_asking_writes_nothing_and_rules_are_apart(client):
    client.delete(KEY)
    assert exchange(client, [{"rule": RULE}]) == {RULE: "-|-"}
    assert not client.exists(KEY), "a question leaves no key behind"
    exchange(client, [{"rule": RULE, "prompt_ratios": [2.0]}])
    got = exchange(client, [{"rule": OTHER}, {"rule": RULE}])
    assert got == {OTHER: "-|-", RULE: "2 0 1|-"}
    assert 0 < client.pttl(KEY) <= 60_000



def test_runs_on_a_cluster(cluster):
    for domain in ("llm", "prod", "eu"):
        key = redis_key("llmrl:", domain, "models", "cal", "rules")
        reply = cluster.eval(SCRIPT, 1, key, json.dumps({"window": 20, "ttl_ms": 60_000,
                                                          "rules": [{"rule": RULE, "outputs": [40, 60]}]}))
        assert [(r.decode(), f.decode()) for r, f in reply] == [(RULE, "-|50 10 2")]
