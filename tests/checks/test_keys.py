"""The harness's copies of the key schema agree with the Rust side: tests/cases/keys.json
is also read by crates/protocol/tests/golden.rs and crates/core's identity tests."""

import json
from pathlib import Path

from stack import redis_key, tenant_of

TABLE = json.loads((Path(__file__).resolve().parents[1] / "cases/keys.json").read_text())


def test_tenant_ids_match_the_filter():
    for case in TABLE["tenants"]:
        assert tenant_of(case["api_key"]) == case["tenant"]


def test_redis_keys_match_the_companion():
    for case in TABLE["redis"]:
        assert redis_key(case["prefix"], case["domain"], case["tenant"], case["kind"], case["name"]) == case["key"]
